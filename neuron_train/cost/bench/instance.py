"""Where a bench runs: the EC2 instance type (the instance metadata service, else the flag, else
'local'), whether that type can run the mode asked for, and the host's facts a result records.
"""

from __future__ import annotations

import os
import platform
import socket
import urllib.request
from pathlib import Path

from neuron_train.common.errors import UsageError
from neuron_train.cost.bench.measure import refuse_inf1_inference
from neuron_train.cost.catalog import load_catalog

IMDS_ENDPOINT = "http://169.254.169.254"


def detect_instance_type(timeout: float = 1.0) -> str | None:
    """The EC2 instance type from the instance metadata service (IMDSv2), or None off EC2.

    Honours the AWS SDKs' variables: AWS_EC2_METADATA_DISABLED=true skips the lookup,
    AWS_EC2_METADATA_SERVICE_ENDPOINT points it elsewhere (tests use a local stub).
    """
    if os.environ.get("AWS_EC2_METADATA_DISABLED", "").lower() == "true":
        return None
    base = os.environ.get("AWS_EC2_METADATA_SERVICE_ENDPOINT", IMDS_ENDPOINT).rstrip("/")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via a proxy
    try:
        token_req = urllib.request.Request(f"{base}/latest/api/token", method="PUT",
                                           headers={"X-aws-ec2-metadata-token-ttl-seconds": "60"})
        token = opener.open(token_req, timeout=timeout).read().decode()
        type_req = urllib.request.Request(f"{base}/latest/meta-data/instance-type",
                                          headers={"X-aws-ec2-metadata-token": token})
        itype = opener.open(type_req, timeout=timeout).read().decode().strip()
    except (OSError, ValueError):  # URLError, timeouts, refused connections: not on EC2
        return None
    return itype or None


def resolve_instance_type(flag: str | None) -> tuple[str, str]:
    """(instance type, how it was found): the metadata service wins; a contradicting flag is an error."""
    detected = detect_instance_type()
    if detected and flag and flag != detected:
        raise UsageError(f"--instance-type {flag} contradicts this machine, which the EC2 metadata "
                         f"service reports as {detected}")
    if detected:
        return detected, "ec2-metadata"
    return (flag, "flag") if flag else ("local", "default")


def check_mode_fits(mode: str, instance_type: str) -> None:
    """Refuse training on a type that cannot train, and inference where bench cannot measure it."""
    spec = load_catalog().get(instance_type)
    if mode == "train" and spec is not None and not spec.can_train:
        raise UsageError(f"{instance_type} cannot train: {spec.train_note}; use --mode infer")
    if mode == "infer":
        refuse_inf1_inference(instance_type)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def host_metadata() -> dict:
    """The host a result was measured on, as its `host` block records it."""
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        mem = None
    try:
        load = round(os.getloadavg()[0], 2)  # a busy host spreads the repeats: say how busy it was
    except OSError:
        load = None
    return {"hostname": socket.gethostname(), "os": platform.platform(), "cpu": _cpu_model(),
            "cpu_count": os.cpu_count(), "memory_gib": round(mem, 1) if mem else None,
            "load_average_1m": load, "python": platform.python_version()}
