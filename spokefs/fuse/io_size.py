"""The preferred I/O size (``st_blksize``) the mount reports per file, chosen so that a reader
taking a small file in small pieces costs one FUSE READ for the whole file (issue 22).

Why. The kernel sizes the read-ahead of a file's first read from that read's size, not from
the mount's read-ahead (``read_ahead_kb`` is only the cap): a first read of 4 KiB at offset 0
reads ahead 16 KiB, then 64 KiB, then the rest, each one FUSE READ (``get_init_ra_size``:
4x the request up to 1/32 of the cap, 2x up to 1/4, the cap beyond). That is what PIL and
``tarfile`` cost: Python's ``open()`` sizes its buffer from ``st_blksize``, which was 4 KiB,
so their first read was 4 KiB. Reporting a file's size (rounded up to a power of two) as its
``st_blksize`` makes such a reader's first read ask for the whole file, and the kernel then
reads it in one FUSE READ (up to the mount's read-ahead, 1 MiB, which is also FUSE's largest
READ). ``cat``/``cp`` already read 128 KiB and more at a time; glibc's stdio uses
``st_blksize`` only below 8 KiB, so C readers through ``fread`` gain nothing from this.

Measured with benchmarks/bench_reads_per_file.py (200 files of ~110 KiB each, cached in the
spoke; FUSE READs per file, kernel 6.18; the read-ahead as the mount really had it):

| reader | 128 KiB read-ahead, 4 KiB blksize (before) | 1 MiB, 4 KiB | 1 MiB, this |
| --- | --- | --- | --- |
| PIL ``Image.open().convert("RGB")`` | 3.37 | 3.00 | 1.00 |
| ``tarfile``, every member | 4.83 | 3.58 | 1.00 |
| ``cat`` | 1.00 | 1.00 | 1.00 |
| ``os.read(fd, 8192)`` to the end (C stdio's reads) | 3.37 | 2.00 | 2.00 |

Bounds. Only regular files up to ``whole_read_max`` get a larger size: the mount's read-ahead
(a first read larger than it is cut to it anyway) and no larger than what the spoke fetches
whole on a first read (``PrefetchConfig.small_file_bytes``), so a whole-file READ never asks
the hub for more than the miss would have fetched. Larger files keep 4 KiB, so their random
readers, buffered or not, read what they did (bytes served / asked for random 4 KiB reads of a
64 MiB file: 0.99 before and after). The cost: a buffered reader of a small file taking a few
pieces at random reads the whole file once (at most ``whole_read_max``) into the page cache,
and its buffer is up to twice the file's size. FUSE also makes ``st_blksize`` the inode's
block size in the kernel (``i_blkbits``), which its page-cache reads consult;
tests/integration/test_reads_per_file.py checks the bytes of buffered, unbuffered, ``pread``
(past the end too) and ``mmap`` reads for sizes around the block and power-of-two edges.
"""

from __future__ import annotations

from spokefs.config import BLOCK_SIZE, SpokeConfig


def whole_read_max(cfg: SpokeConfig) -> int:
    """The largest file that reports its size as ``st_blksize``: the kernel's read-ahead
    (a larger first read is cut to it anyway) and no more than a first read of a small file
    fetches from the hub anyway (``PrefetchConfig.small_file_bytes``)."""
    return min(cfg.kernel_readahead_kib * 1024, cfg.prefetch.small_file_bytes)


def preferred_io_size(size: int, whole_read_max: int) -> int:
    """The ``st_blksize`` of a regular file of ``size`` bytes: the smallest power of two that
    holds the file (at least one block) for files up to ``whole_read_max``, else one block."""
    if size <= BLOCK_SIZE or size > whole_read_max:
        return BLOCK_SIZE
    return 1 << (size - 1).bit_length()
