"""Observability end to end: a real Prometheus scrapes a real spoke and hub, and the
dashboard's and the rules' expressions give the numbers the reads imply.

- ``test_prometheus_sees_exact_hit_ratio``: Debian's ``prometheus`` binary scrapes a mounted
  spoke and its hub every second, with ``deploy/prometheus/alerts.yml`` loaded. The test reads
  N one-block files cold (N misses), then warm twice with the page cache dropped (2N hits),
  and checks through ``/api/v1/query`` that the dashboard's hit-ratio expression is exactly
  2/3, that the recording rule agrees, that bytes by source and warm-up progress are right,
  that every dashboard expression runs, and that no alert fires.
- ``test_dashboard_metric_names_exist``: every ``spokefs_*``/``hubd_*`` name in the dashboard
  and the rules is a metric of a real ``/metrics`` scrape.
- ``test_promtool_*``: the rules, their unit tests and the example scrape config pass promtool.

Why the ratio is exact: all counters exist from the spoke's start (value 0 in the first
scrape), every series of one target shares the scrape timestamps, and the window covers the
whole run; so ``rate()`` extrapolates hits and misses by the same factor and the factor cancels.
One-block files make the block counts independent of how the kernel splits reads, and the
spoke runs with ``--no-prefetch``, so that directory fills (which start at a directory's
first open) do not turn the cold pass's misses into hits.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import procs
from tests.helpers.page_cache import drop_pages
from tests.helpers.procs import HubProcess, SpokeMount

REPO = procs.REPO_ROOT
DASHBOARD = REPO / "deploy" / "grafana" / "spokefs.json"
RULES = REPO / "deploy" / "prometheus" / "alerts.yml"
RULES_TEST = REPO / "deploy" / "prometheus" / "alerts_test.yml"
SCRAPE_EXAMPLE = REPO / "deploy" / "prometheus" / "prometheus.yml"

PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
_NO_PROM = "Debian's prometheus package is not installed (bash deploy/setup.sh --test installs it)"
needs_prometheus = pytest.mark.skipif(PROMETHEUS is None, reason=_NO_PROM)
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason=_NO_PROM)

BLOCK = 4096
DIRS, FILES_PER_DIR = 3, 4
N_FILES = DIRS * FILES_PER_DIR
WARM_PASSES = 2
WINDOW = "10m"  # stands for $__rate_interval: longer than the whole run
# A metric name in an expression; not part of a recorded name such as instance:spokefs_x:rate5m.
METRIC_NAME_RE = re.compile(r"(?<![\w:])((?:spokefs|hubd)_\w+)(?![\w:])")
QUERY_TIMEOUT_S = 30.0


# -- a Prometheus server ----------------------------------------------------------------------


@dataclass
class Prometheus:
    """A running ``prometheus`` child and its HTTP API."""

    url: str
    proc: subprocess.Popen
    log_path: Path

    def api(self, path: str, **params: str) -> dict:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}{path}?{query}", timeout=10) as resp:
            body = json.load(resp)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        """An instant query; the result vector (raises on a bad expression)."""
        try:
            data = self.api("/api/v1/query", query=expr)
        except urllib.error.HTTPError as exc:
            pytest.fail(f"Prometheus rejected {expr!r}: {exc.read().decode(errors='replace')}")
        return data["result"] if data["resultType"] == "vector" else [{"value": data["result"]}]

    def scalar(self, expr: str) -> float | None:
        """The value of a one-element result (None when empty)."""
        result = self.query(expr)
        assert len(result) <= 1, f"{expr} gave {len(result)} series"
        return float(result[0]["value"][1]) if result else None

    def wait_for(self, expr: str, want: float, rel: float = 1e-9) -> float:
        """Poll ``expr`` until it equals ``want``; fail with the last value after a while."""
        deadline = time.monotonic() + QUERY_TIMEOUT_S
        while True:
            got = self.scalar(expr)
            if got is not None and math.isclose(got, want, rel_tol=rel, abs_tol=1e-12):
                return got
            if time.monotonic() > deadline:
                pytest.fail(f"{expr} = {got} after {QUERY_TIMEOUT_S}s, want {want}\n"
                            f"prometheus log:\n{self.log()[-3000:]}", pytrace=False)
            time.sleep(0.25)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def scrape_config(spoke_target: str, hub_target: str, rules: Path) -> str:
    # JSON is YAML: no YAML library needed.
    return json.dumps({
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(rules)],
        "scrape_configs": [
            {"job_name": "spokefs", "static_configs": [{"targets": [spoke_target]}]},
            {"job_name": "hubd", "static_configs": [{"targets": [hub_target]}]},
        ],
    }, indent=2)


@contextlib.contextmanager
def running_prometheus(config: str, workdir: Path) -> Iterator[Prometheus]:
    """``prometheus`` on a free loopback port with its data in ``workdir``; always stopped."""
    assert PROMETHEUS is not None
    workdir.mkdir(parents=True, exist_ok=True)
    cfg = workdir / "prometheus.yml"
    cfg.write_text(config)
    port = procs.free_port()
    log_path = workdir / "prometheus.log"
    cmd = [PROMETHEUS, f"--config.file={cfg}", f"--storage.tsdb.path={workdir / 'data'}",
           f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=1h",
           "--log.level=warn"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, cwd=workdir)
    prom = Prometheus(f"http://127.0.0.1:{port}", proc, log_path)
    try:
        deadline = time.monotonic() + procs.START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"prometheus exited with {proc.returncode}\n{prom.log()}",
                            pytrace=False)
            with contextlib.suppress(OSError), \
                    urllib.request.urlopen(f"{prom.url}/-/ready", timeout=2) as resp:
                if resp.status == 200:
                    break
            if time.monotonic() > deadline:
                pytest.fail(f"prometheus not ready after {procs.START_TIMEOUT_S}s\n{prom.log()}",
                            pytrace=False)
            time.sleep(0.1)
        yield prom
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=procs.STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=procs.STOP_TIMEOUT_S)


# -- the spoke and hub under observation ------------------------------------------------------


@dataclass
class Stack:
    hub: HubProcess
    spoke: SpokeMount
    metrics_url: str
    files: dict[str, bytes]  # path relative to the export root -> contents
    prometheus: Prometheus | None


def _make_tree(root: Path) -> dict[str, bytes]:
    files = {}
    for d in range(DIRS):
        (root / f"d{d}").mkdir(parents=True)
        for f in range(FILES_PER_DIR):
            rel = f"d{d}/f{f}.bin"
            data = os.urandom(BLOCK)
            (root / rel).write_bytes(data)
            files[rel] = data
    return files


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, make_mountpoint) -> Iterator[Stack]:
    """A hub exporting N one-block files, a spoke mounting it with metrics on a free port,
    and (when installed) Prometheus scraping both every second."""
    tmp = tmp_path_factory.mktemp("obs")
    files = _make_tree(tmp / "export")
    hub = HubProcess(tmp / "export", tmp / "hub")
    spoke = None
    try:
        hub.start()
        # picked after the hub bound its own port 0: picked before, the hub could take it
        metrics_port = procs.free_port()
        spoke = SpokeMount(hub.url, make_mountpoint("obs"), tmp / "cache", tmp / "spoke",
                           ("--metrics-port", str(metrics_port), "--metrics-addr", "127.0.0.1",
                            "--no-prefetch"))
        spoke.start()
        metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        with contextlib.ExitStack() as prom_stack:
            prom = None
            if PROMETHEUS is not None:
                hub_target = hub.url.removeprefix("http://")
                config = scrape_config(f"127.0.0.1:{metrics_port}", hub_target, RULES)
                prom = prom_stack.enter_context(running_prometheus(config, tmp / "prometheus"))
            yield Stack(hub, spoke, metrics_url, files, prom)
    finally:
        if spoke is not None:
            spoke.unmount()
        hub.stop()
    assert spoke is not None
    spoke.assert_clean_exit()


def _fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.read().decode()


# -- the dashboard ----------------------------------------------------------------------------


def dashboard_exprs(dash: dict) -> list[tuple[str, str]]:
    """(panel title, expr) of every target, rows' nested panels included."""
    out = []

    def walk(panels: list[dict]) -> None:
        for p in panels:
            out.extend((p["title"], t["expr"]) for t in p.get("targets", []))
            walk(p.get("panels", []))

    walk(dash["panels"])
    return out


def template_queries(dash: dict) -> list[str]:
    return [v["definition"] for v in dash["templating"]["list"] if v["type"] == "query"]


def concrete(expr: str) -> str:
    """A dashboard expression with Grafana's variables replaced by what selects everything."""
    return (expr.replace("$__rate_interval", WINDOW).replace("$instance", ".*")
            .replace("$job", ".*").replace("$hub", ".*"))


def panel_expr(dash: dict, title: str, ref: int = 0) -> str:
    exprs = [e for t, e in dashboard_exprs(dash) if t == title]
    assert exprs, f"no panel {title!r} in the dashboard"
    return exprs[ref]


def rule_exprs() -> tuple[list[str], set[str]]:
    """Every rule expression of alerts.yml and the names it records.

    A small reader of the ``record:`` and ``expr:`` keys (one-line or ``|`` block), so the
    tests need no YAML library; ``promtool check rules`` checks the YAML itself.
    """
    exprs, recorded = [], set()
    lines = RULES.read_text().splitlines()
    i = 0
    while i < len(lines):
        stripped = lines[i].strip()
        if stripped.startswith("- record:"):
            recorded.add(stripped.split(":", 1)[1].strip())
        if stripped.startswith("expr:"):
            rest = stripped.split(":", 1)[1].strip()
            if rest != "|":
                exprs.append(rest)
            else:
                indent = len(lines[i]) - len(lines[i].lstrip())
                block = []
                i += 1
                while i < len(lines) and (not lines[i].strip()
                                          or len(lines[i]) - len(lines[i].lstrip()) > indent):
                    block.append(lines[i].strip())
                    i += 1
                exprs.append("\n".join(block))
                continue
        i += 1
    return exprs, recorded


def scraped_names(text: str) -> set[str]:
    """Names a PromQL expression may use for the families of one /metrics scrape."""
    suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count",
                                                                "_created"),
                "summary": ("_sum", "_count", "_created"), "gauge": ("",), "info": ("_info",)}
    names = set()
    for fam in text_string_to_metric_families(text):
        names.update(fam.name + s for s in suffixes.get(fam.type, ("",)))
        names.update(s.name for s in fam.samples)
    return names


def test_dashboard_is_valid_grafana_json() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["schemaVersion"] >= 36
    ds = [v for v in dash["templating"]["list"] if v["name"] == "datasource"]
    assert ds and ds[0]["type"] == "datasource" and ds[0]["query"] == "prometheus"
    ids = []

    def walk(panels: list[dict]) -> None:
        for p in panels:
            ids.append(p["id"])
            if p["type"] != "row":
                assert p["datasource"]["uid"] == "${datasource}", p["title"]
                for t in p["targets"]:
                    assert t["datasource"]["uid"] == "${datasource}", p["title"]
            walk(p.get("panels", []))

    walk(dash["panels"])
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    titles = {t for t, _ in dashboard_exprs(dash)}
    for want in ("Block hit ratio", "Throughput by source", "Read latency quantiles",
                 "Link bytes/s", "Prefetch efficiency", "Cache fill", "Hub errors and retries",
                 "Warm-up progress"):
        assert want in titles
    assert "histogram_quantile" in panel_expr(dash, "Read latency quantiles")
    assert "spokefs_read_seconds_bucket" in panel_expr(dash, "Read latency quantiles")


@pytest.mark.fuse
def test_dashboard_metric_names_exist(stack: Stack) -> None:
    known = scraped_names(_fetch(stack.metrics_url)) | scraped_names(
        _fetch(f"{stack.hub.url}/metrics"))
    dash = json.loads(DASHBOARD.read_text())
    exprs = [e for _, e in dashboard_exprs(dash)] + template_queries(dash)
    rules, recorded = rule_exprs()
    assert len(rules) >= 10 and recorded
    used = {m for e in exprs + rules for m in METRIC_NAME_RE.findall(e)}
    assert len(used) >= 25, sorted(used)
    missing = sorted(used - known)
    assert not missing, f"not in a real /metrics scrape of spokefs and hubd: {missing}"


# -- Prometheus against the real thing --------------------------------------------------------


def _read_all(stack: Stack, *, drop_first: bool) -> None:
    for rel, want in stack.files.items():
        path = stack.spoke.mnt / rel
        if drop_first:
            drop_pages(path)
        assert path.read_bytes() == want, rel


@pytest.mark.fuse
@needs_prometheus
def test_prometheus_sees_exact_hit_ratio(stack: Stack) -> None:
    prom = stack.prometheus
    assert prom is not None
    dash = json.loads(DASHBOARD.read_text())
    # both targets up, and a first scrape of the spoke before any read (all counters at 0)
    prom.wait_for('sum(up{job=~"spokefs|hubd"})', 2)
    prom.wait_for("sum(spokefs_block_misses_total) + sum(spokefs_block_hits_total)", 0)
    # every series the ratio and throughput use exists before its first increment, or rate()
    # would miss that increment (labelled counters: initialise their labels in metrics.py)
    assert prom.scalar("count(spokefs_block_hits_total)"), "hits not exported before a hit"
    assert prom.scalar("count(spokefs_read_bytes_total)") == 2, "read bytes: source labels"

    _read_all(stack, drop_first=False)  # cold: one miss per file
    for _ in range(WARM_PASSES):
        _read_all(stack, drop_first=True)  # warm: one hit per file, from the spoke's cache
    hits, misses = WARM_PASSES * N_FILES, N_FILES
    prom.wait_for("sum(spokefs_block_misses_total)", misses)
    prom.wait_for("sum(spokefs_block_hits_total)", hits)

    want = hits / (hits + misses)
    ratio_expr = concrete(panel_expr(dash, "Block hit ratio"))
    assert prom.scalar(ratio_expr) == pytest.approx(want, rel=1e-9), ratio_expr
    # the recording rule of alerts.yml (evaluated every second) agrees
    prom.wait_for("instance:spokefs_block_hit_ratio:rate5m", want)

    # bytes by source, as counted (the throughput panel is their rate)
    by_source = {r["metric"]["source"]: float(r["value"][1])
                 for r in prom.query("sum by (source) (spokefs_read_bytes_total)")}
    assert by_source == {"hub": misses * BLOCK, "cache": hits * BLOCK}
    rates = {r["metric"]["source"]: float(r["value"][1])
             for r in prom.query(concrete(panel_expr(dash, "Throughput by source")))}
    assert rates["cache"] / rates["hub"] == pytest.approx(hits / misses, rel=1e-9), rates
    # everything was read, so warm-up is complete; namespace bytes are the files' bytes
    assert prom.scalar("max(spokefs_namespace_bytes)") == N_FILES * BLOCK
    assert prom.scalar(concrete(panel_expr(dash, "Warm-up progress"))) == 1.0
    assert prom.scalar("max(spokefs_link_bytes_total)") >= N_FILES * BLOCK
    assert prom.scalar('sum(hubd_requests_total{route!="/metrics"})') > 0

    # every dashboard expression runs; the ones over spokefs series return data
    for title, expr in dashboard_exprs(dash):
        result = prom.query(concrete(expr))
        if title in ("Block hit ratio", "Throughput by source", "Read latency quantiles",
                     "Link bytes/s", "Cache fill", "Warm-up progress"):
            assert result, f"{title}: {expr} returned nothing"

    rules = prom.api("/api/v1/rules")["groups"]
    assert {g["name"] for g in rules} == {"spokefs-recording", "spokefs-alerts"}
    for g in rules:
        for r in g["rules"]:
            assert r["health"] == "ok", r
    firing = [a for a in prom.api("/api/v1/alerts")["alerts"] if a["state"] == "firing"]
    assert not firing, firing


# -- promtool ---------------------------------------------------------------------------------


def _promtool(*args: str) -> subprocess.CompletedProcess:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60,
                          check=False, cwd=RULES.parent)


@needs_promtool
def test_promtool_check_rules() -> None:
    r = _promtool("check", "rules", str(RULES))
    assert r.returncode == 0, r.stdout + r.stderr


@needs_promtool
def test_promtool_rule_unit_tests() -> None:
    r = _promtool("test", "rules", str(RULES_TEST))
    assert r.returncode == 0, r.stdout + r.stderr


@needs_promtool
def test_promtool_check_scrape_config() -> None:
    r = _promtool("check", "config", str(SCRAPE_EXAMPLE))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "alerts.yml" in r.stdout + r.stderr  # the example loads the rules
