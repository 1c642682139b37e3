"""``mount.spokefs``: the mount(8) helper behind ``fuse.spokefs`` lines in /etc/fstab.

For a filesystem type ``fuse.spokefs`` mount(8) runs ``/sbin/mount.fuse.spokefs`` (a
symlink to this console script) as::

    mount.fuse.spokefs SOURCE DIR [-sfnv] [-o OPTIONS] [-t fuse.spokefs]

with OPTIONS the fstab line's fourth field. The helper turns ``key=value`` options into
``spokefs mount`` flags (``cache_dir=D`` -> ``--cache-dir D``, ``no_prefetch`` ->
``--no-prefetch``), drops the generic ones that mount(8) and systemd act on themselves
(``_netdev``, ``nofail``, ``noauto``, ``x-systemd.*``, ...), refuses anything else with one
line, and runs ``spokefs mount SOURCE DIR ... --daemon`` in this process: it returns 0 once
the mount is ready (so ``mount -a`` and systemd's ``.mount`` units order on a working
mount), or 1 with one ``spokefs: error: ...`` line, nothing mounted. ``umount DIR`` needs no
helper: the kernel ends the FUSE session and the daemon exits.

Why not mount.fuse3's own dispatch (it runs a program named after the subtype, found on
PATH, with ``SOURCE DIR -o OPTIONS``)? mount(8) tries ``mount.fuse.spokefs`` first anyway,
PATH at boot rarely holds a virtualenv's bin directory, and mount.fuse3 would pass the
options through unchecked.
"""

from __future__ import annotations

import sys

from spokefs.cli import main as cli

VALUE_OPTIONS = frozenset({
    "cache_dir", "cache_size", "token_file", "ca_file", "metrics_port", "metrics_addr",
    "hub_deadline", "mount_deadline", "refresh_interval", "log_file", "log_level", "uid",
    "gid", "tier", "hub_failover_after", "replay", "max_pinned_share", "open_mode", "workers",
})
FLAG_OPTIONS = frozenset({"no_prefetch", "no_trace"})
REQUIRED = ("cache_dir", "cache_size")
# Acted on by mount(8), systemd or the kernel's defaults for FUSE, or meaningless for a
# read-only network filesystem: accepted and dropped.
GENERIC_OPTIONS = frozenset({
    "defaults", "auto", "noauto", "nofail", "user", "users", "nouser", "owner", "group",
    "ro", "rw", "exec", "noexec", "suid", "nosuid", "dev", "nodev", "sync", "async",
    "atime", "noatime", "relatime", "strictatime", "nodiratime", "diratime", "lazytime",
    "nolazytime", "allow_other", "default_permissions",
})
_USAGE = ("usage: mount.spokefs HUB_URL[,HUB_URL...] DIR -o cache_dir=D,cache_size=SIZE["
          ",token_file=F,ca_file=F,tier=URL,metrics_port=P,metrics_addr=A,hub_deadline=S,"
          "hub_failover_after=S,mount_deadline=S,refresh_interval=S,log_file=F,log_level=L,"
          "uid=N,gid=N,replay=TRACE,max_pinned_share=F,open_mode=M,workers=N,no_prefetch,"
          "no_trace]")


class HelperError(Exception):
    """A bad command line or option: one line, exit 1 (mount(8)'s "usage" code is 1)."""


def parse_args(argv: list[str]) -> tuple[str, str, list[str], set[str]]:
    """``(source, dir, options, flags)`` from mount(8)'s helper command line.

    ``flags`` holds the single-letter switches seen (``s``, ``f``, ``n``, ``v``).
    """
    positional: list[str] = []
    options: list[str] = []
    flags: set[str] = set()
    args = iter(argv)
    for arg in args:
        if arg in ("-o", "-t", "-N"):
            value = next(args, None)
            if value is None:
                raise HelperError(f"{arg} needs a value")
            if arg == "-o":
                options.extend(split_options(value))
            elif arg == "-N":
                raise HelperError("-N (another mount namespace) is not supported")
        elif arg.startswith("-o") and len(arg) > 2:
            options.extend(split_options(arg[2:]))
        elif arg.startswith("-") and len(arg) > 1 and set(arg[1:]) <= set("sfnvrw"):
            flags |= set(arg[1:])
        elif arg.startswith("-") and len(arg) > 1:
            raise HelperError(f"unknown switch {arg}")
        else:
            positional.append(arg)
    if len(positional) != 2:
        raise HelperError(_USAGE)
    return positional[0], positional[1], options, flags


def split_options(text: str) -> list[str]:
    """``a=1,b,c=2`` -> ``["a=1", "b", "c=2"]`` (empty items dropped)."""
    return [item for item in text.split(",") if item]


def spokefs_args(options: list[str], sloppy: bool) -> list[str]:
    """The ``spokefs mount`` flags for the fstab options.

    Raises:
        HelperError: an unknown option (unless ``sloppy``), a value missing or given where
            none belongs, a token given inline, or a required option missing.
    """
    out: list[str] = []
    seen: set[str] = set()
    for item in options:
        key, sep, value = item.partition("=")
        if key == "token":
            raise HelperError("put the token in a file and give token_file=PATH: an "
                              "option's value is visible in the mount table")
        if _generic(key):
            continue
        if key in VALUE_OPTIONS:
            if not sep or not value:
                raise HelperError(f"option {key} needs a value: {key}=...")
            out += [f"--{key.replace('_', '-')}", value]
        elif key in FLAG_OPTIONS:
            if sep:
                raise HelperError(f"option {key} takes no value")
            out.append(f"--{key.replace('_', '-')}")
        elif sloppy:
            continue
        else:
            raise HelperError(f"unknown option {key!r}; spokefs options: "
                              f"{_USAGE.split(' -o ', 1)[1]}")
        seen.add(key)
    missing = [key for key in REQUIRED if key not in seen]
    if missing:
        raise HelperError(f"missing option {' and '.join(f'{k}=' for k in missing)}: "
                          f"{_USAGE}")
    return out


def _generic(key: str) -> bool:
    return (key in GENERIC_OPTIONS or key.startswith(("x-", "_", "comment"))
            or key in ("context", "fscontext", "defcontext", "rootcontext"))


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``mount.spokefs`` (and ``/sbin/mount.fuse.spokefs``)."""
    try:
        source, target, options, flags = parse_args(sys.argv[1:] if argv is None else argv)
        args = spokefs_args(options, sloppy="s" in flags)
    except HelperError as exc:
        print(f"mount.spokefs: error: {exc}", file=sys.stderr)
        return 1
    command = ["mount", source, target, *args, "--daemon"]
    if "v" in flags:
        print("mount.spokefs: spokefs " + " ".join(command), file=sys.stderr)
    if "f" in flags:  # mount -f: pretend
        return 0
    return cli.main(command)
