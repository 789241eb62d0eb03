#!/usr/bin/env bash
# Provision an Ubuntu 22.04 trn1/inf2 machine for neuron-train: the pinned Neuron SDK (driver,
# runtime, collectives, tools, EFA, neuronx-cc, torch-neuronx) and this project in a venv.
#
# ami/neuron-train.pkr.hcl runs it to build an image; it also works on its own, run as root on a
# fresh instance or given as EC2 user-data (docs/ami.md shows both). Safe to run again.
#
# Settings (environment variables; flags in parentheses):
#   NT_SRC           project source: a directory or a .tar.gz of one            (--src PATH)
#   NT_GIT_URL       ... or a git repository to clone at NT_GIT_REF             (--git URL --ref REF)
#   NT_NEURON_SDK    Neuron SDK release (default: the pin in the source's
#                    neuron_train/data/neuron_versions.json, the one place versions live)
#   NT_EFA           auto | yes | no: install the EFA software (auto: when absent)  (--efa MODE)
#   NT_PREWARM_ARGS  train flags to precompile into the image's compile cache    (--prewarm ARGS)
#   NT_PREWARM_NPROCS  with NT_PREWARM_ARGS: the processes per node you train with, one precompile
#                    each ("32", "1 32"); the world size is part of every graph (--prewarm-nprocs N..)
#   NT_PREFIX        install prefix (default /opt/neuron-train)
#   NT_CACHE_DIR     compile cache on local disk (default /var/tmp/neuron-train/compile_cache)
#   NT_USER          the account that trains and owns the cache (default ubuntu)
#
# Security: each repository key is checked against the fingerprint pinned in the versions file
# before anything is installed with it; the EFA tarball's signature is verified with gpgv against
# that key alone; nothing downloaded is piped into a shell.
#
# NT_* pins (NT_AWS_NEURONX_DKMS, NT_REPO_APT, ...) are assigned by load_pins through printf -v.
# shellcheck disable=SC2154
set -euo pipefail

NT_PREFIX=${NT_PREFIX:-/opt/neuron-train}
NT_CACHE_DIR=${NT_CACHE_DIR:-/var/tmp/neuron-train/compile_cache}
NT_USER=${NT_USER:-ubuntu}
NT_EFA=${NT_EFA:-auto}
NT_GIT_REF=${NT_GIT_REF:-main}
NEURON_KEYRING=/etc/apt/keyrings/aws-neuron.gpg
APT_COMPONENTS=(aws-neuronx-dkms aws-neuronx-collectives aws-neuronx-runtime-lib aws-neuronx-tools)
export DEBIAN_FRONTEND=noninteractive

log() { printf '[provision %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }
die() { log "error: $*"; exit 1; }

usage() {
    sed -n '2,/^# NT_\* pins/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//; s/^#$//'
}

parse_args() {
    while (($#)); do
        case $1 in
            --src) NT_SRC=${2:?--src needs a path}; shift 2 ;;
            --git) NT_GIT_URL=${2:?--git needs a URL}; shift 2 ;;
            --ref) NT_GIT_REF=${2:?--ref needs a tag or branch}; shift 2 ;;
            --efa) NT_EFA=${2:?--efa needs auto, yes or no}; shift 2 ;;
            --prewarm) NT_PREWARM_ARGS=${2:?--prewarm needs train flags}; shift 2 ;;
            --prewarm-nprocs) NT_PREWARM_NPROCS=${2:?--prewarm-nprocs needs process counts}; shift 2 ;;
            -h | --help) usage; exit 0 ;;
            *) die "unknown argument: $1 (see --help)" ;;
        esac
    done
    case $NT_EFA in auto | yes | no) ;; *) die "NT_EFA must be auto, yes or no, not '$NT_EFA'" ;; esac
    check_prewarm
}

# Before anything is installed: a pre-warm names the world sizes it builds. A cache warmed for one
# process (the precompile default) covers nothing of a 32-process run: every graph differs.
check_prewarm() {
    local n
    [[ -n ${NT_PREWARM_ARGS:-} ]] || return 0
    [[ -n ${NT_PREWARM_NPROCS:-} ]] || die "NT_PREWARM_ARGS is set but NT_PREWARM_NPROCS is not: name the" \
        "processes per node you train with (e.g. 32 on trn1.32xlarge, '1 32' for both); a multi-node world" \
        "is pre-warmed by its own job (scripts/slurm_train.sbatch with NEURON_TRAIN_PREWARM=1)"
    for n in $NT_PREWARM_NPROCS; do
        [[ $n =~ ^[1-9][0-9]*$ ]] || die "NT_PREWARM_NPROCS must be process counts (e.g. '1 32'), not '$n'"
    done
}

# ----------------------------------------------------------------------------- pins and keys

# Print KEY=value for every pin of the chosen release; a release not in the file is an error.
pins_of() {
    NT_NEURON_SDK=${NT_NEURON_SDK:-} python3 - "$1" <<'PY'
import json, os, sys
pins = json.load(open(sys.argv[1]))
sdk = os.environ["NT_NEURON_SDK"] or pins["neuron_sdk"]
if sdk not in pins["releases"]:
    sys.exit(f"Neuron SDK {sdk} is not in {sys.argv[1]} (known: {', '.join(pins['releases'])})")
def var(name): return "NT_" + name.upper().replace("-", "_")
out = {"NT_NEURON_SDK": sdk, "NT_EFA_INSTALLER": pins["efa_installer"]}
out.update({var(k): v for k, v in pins["releases"][sdk].items()})
out.update({var(k): v for k, v in pins["framework"].items()})
out.update({var("repo_" + k): v for k, v in pins["repositories"].items()})
print("\n".join(f"{k}={v}" for k, v in out.items()))
PY
}

# Set the NT_* pins from the versions file; variables already set in the environment win.
load_pins() {
    local file=$1 text key value
    [[ -f $file ]] || die "no versions file: $file"
    text=$(pins_of "$file") || die "cannot read the pins in $file"
    while IFS='=' read -r key value; do
        [[ $key =~ ^NT_[A-Z0-9_]+$ && $value =~ ^[A-Za-z0-9.:/_+-]+$ ]] || die "bad pin: $key=$value"
        [[ -n ${!key:-} ]] || printf -v "$key" '%s' "$value"
    done <<<"$text"
}

# The primary-key fingerprints in a key file (armored or binary), one per line.
key_fingerprints() {
    local home rc=0
    home=$(mktemp -d)
    GNUPGHOME=$home gpg --batch --quiet --with-colons --show-keys "$1" 2>/dev/null |
        awk -F: '$1 == "pub" { want = 1; next } $1 == "fpr" && want { print $10; want = 0 }' || rc=$?
    rm -rf "$home"
    return "$rc"
}

# Succeed only when the file holds exactly one key and it has the expected fingerprint: an extra
# key in the file would be trusted by apt as much as the right one.
verify_key() {
    local file=$1 expected=$2 found
    found=$(key_fingerprints "$file") || true
    if [[ $found != "$expected" ]]; then
        log "key $file: expected fingerprint $expected, found: ${found:-none}"
        return 1
    fi
}

# A binary keyring for apt's signed-by / gpgv from a verified key file.
write_keyring() {
    local key=$1 keyring=$2
    install -d -m 0755 "$(dirname "$keyring")"
    if grep -q -- '-----BEGIN PGP PUBLIC KEY BLOCK-----' "$key"; then
        gpg --batch --yes --dearmor -o "$keyring" "$key"
    else
        install -m 0644 "$key" "$keyring"
    fi
    chmod 0644 "$keyring"
}

# Check a detached signature with gpgv against the given key alone, after pinning that key.
verify_signature() {
    local key=$1 sig=$2 file=$3 expected=$4 keyring rc=0
    verify_key "$key" "$expected" || return 1
    keyring=$(mktemp)
    write_keyring "$key" "$keyring"
    gpgv --keyring "$keyring" "$sig" "$file" >&2 || rc=$?
    rm -f "$keyring"
    return "$rc"
}

download() {  # download URL FILE: HTTPS only, fail on HTTP errors, retry transient ones
    curl --fail --silent --show-error --location --proto '=https' --tlsv1.2 \
        --retry 5 --retry-delay 3 --output "$2" "$1"
}

# ----------------------------------------------------------------------------- steps

check_platform() {
    ((EUID == 0)) || die "run as root (sudo)"
    # shellcheck source=/dev/null
    . /etc/os-release
    [[ ${VERSION_CODENAME:-} == jammy ]] ||
        log "warning: tested on Ubuntu 22.04 (jammy); this is ${PRETTY_NAME:-unknown}"
    [[ $(uname -m) == x86_64 ]] || die "trn1/inf2 are x86_64; this is $(uname -m)"
    id "$NT_USER" >/dev/null 2>&1 || die "no user '$NT_USER' to own the compile cache (set NT_USER)"
}

install_prerequisites() {
    log "installing build prerequisites"
    apt-get update -y
    local headers=("linux-headers-$(uname -r)")
    # The -aws meta package brings the headers of future kernels, so DKMS rebuilds the driver.
    [[ $(uname -r) == *-aws ]] && headers+=(linux-headers-aws)
    apt-get install -y --no-install-recommends ca-certificates curl gnupg git python3-venv \
        python3-dev g++ "${headers[@]}"
}

fetch_source() {
    SRC_DIR=$NT_PREFIX/src
    if [[ -n ${NT_SRC:-} && -d $NT_SRC ]]; then
        SRC_DIR=$(cd "$NT_SRC" && pwd)
    elif [[ -n ${NT_SRC:-} && -f $NT_SRC ]]; then
        log "unpacking $NT_SRC into $SRC_DIR"
        rm -rf "$SRC_DIR.new" && mkdir -p "$SRC_DIR.new"
        tar -xzf "$NT_SRC" -C "$SRC_DIR.new"
        rm -rf "$SRC_DIR" && mv "$SRC_DIR.new" "$SRC_DIR"
    elif [[ -n ${NT_GIT_URL:-} ]]; then
        log "cloning $NT_GIT_URL at $NT_GIT_REF into $SRC_DIR"
        rm -rf "$SRC_DIR.new"
        git clone --quiet --depth 1 --branch "$NT_GIT_REF" "$NT_GIT_URL" "$SRC_DIR.new"
        rm -rf "$SRC_DIR" && mv "$SRC_DIR.new" "$SRC_DIR"
    else
        die "no project source: set NT_SRC (directory or .tar.gz) or NT_GIT_URL (see --help)"
    fi
    [[ -f $SRC_DIR/pyproject.toml ]] || die "$SRC_DIR is not the neuron-train project (no pyproject.toml)"
}

add_neuron_apt_repo() {
    local tmp=$1 list=/etc/apt/sources.list.d/neuron.list other
    log "adding the Neuron apt repository (key $NT_REPO_APT_KEY_FINGERPRINT)"
    download "$NT_REPO_APT_KEY_URL" "$tmp/neuron.pub"
    verify_key "$tmp/neuron.pub" "$NT_REPO_APT_KEY_FINGERPRINT" || die "the Neuron apt key does not match the pin"
    write_keyring "$tmp/neuron.pub" "$NEURON_KEYRING"
    # A second entry for the same repository (the DLAMI ships one, trusted via apt-key) with
    # another signed-by makes apt refuse both: keep ours only.
    for other in /etc/apt/sources.list.d/*.list; do
        [[ -f $other && $other != "$list" ]] || continue
        if grep -q "${NT_REPO_APT#https://}" "$other"; then
            log "disabling $other (same repository)" && mv "$other" "$other.disabled"
        fi
    done
    printf 'deb [signed-by=%s] %s %s main\n' "$NEURON_KEYRING" "$NT_REPO_APT" "$VERSION_CODENAME" >"$list"
    apt-get update -y
}

install_neuron_packages() {
    local pkg var wanted=()
    for pkg in "${APT_COMPONENTS[@]}"; do
        var=NT_${pkg^^} && var=${var//-/_}
        wanted+=("$pkg=${!var}*")  # '*' matches the Debian revision (e.g. 2.23.112.0-9b5179492)
    done
    log "installing ${wanted[*]}"
    apt-mark unhold "${APT_COMPONENTS[@]}" >/dev/null 2>&1 || true
    apt-get install -y --allow-downgrades -o Dpkg::Options::=--force-confold "${wanted[@]}"
    # Held, so an unattended upgrade cannot split driver, runtime and compiler across releases.
    apt-mark hold "${APT_COMPONENTS[@]}"
}

install_efa() {
    local tmp=$1 base name
    if [[ $NT_EFA == no ]] || [[ $NT_EFA == auto && -x /opt/amazon/efa/bin/fi_info ]]; then
        log "EFA: skipped (NT_EFA=$NT_EFA)"
        return
    fi
    name=aws-efa-installer-$NT_EFA_INSTALLER.tar.gz
    base=$NT_REPO_EFA_URL
    log "installing EFA $NT_EFA_INSTALLER (key $NT_REPO_EFA_KEY_FINGERPRINT)"
    download "$base/aws-efa-installer.key" "$tmp/efa.key"
    download "$base/$name" "$tmp/$name"
    download "$base/$name.sig" "$tmp/$name.sig"
    verify_signature "$tmp/efa.key" "$tmp/$name.sig" "$tmp/$name" "$NT_REPO_EFA_KEY_FINGERPRINT" ||
        die "$name: not signed by the pinned EFA key"
    tar -xzf "$tmp/$name" -C "$tmp"
    (cd "$tmp/aws-efa-installer" && ./efa_installer.sh --yes)
}

configure_system() {
    log "system limits, reserved ports, PATH"
    # 32 workers and their collectives need more than the default 1024 open files.
    cat >/etc/security/limits.d/99-neuron-train.conf <<'EOF'
*    soft nofile 65536
*    hard nofile 65536
root soft nofile 65536
root hard nofile 65536
EOF
    # The multi-node ports of scripts/slurm_train.sbatch: the torchrun rendezvous and the Neuron
    # root communicator; reserved so no ephemeral connection takes them first.
    echo 'net.ipv4.ip_local_reserved_ports = 41000,46820' >/etc/sysctl.d/99-neuron-train.conf
    sysctl -q -p /etc/sysctl.d/99-neuron-train.conf
    cat >/etc/profile.d/neuron-train.sh <<EOF
export PATH="/opt/aws/neuron/bin:$NT_PREFIX/venv/bin:\$PATH"
EOF
    # systemd-tmpfiles empties /var/tmp of files unused for 30 days: keep the compile cache.
    echo "x ${NT_CACHE_DIR%/*}" >/etc/tmpfiles.d/neuron-train.conf
    install -d -m 0755 -o "$NT_USER" -g "$NT_USER" "${NT_CACHE_DIR%/*}" "$NT_CACHE_DIR"
}

install_python_env() {
    local venv=$NT_PREFIX/venv py
    log "Python venv $venv: torch-neuronx $NT_TORCH_NEURONX, neuronx-cc $NT_NEURONX_CC"
    [[ -x $venv/bin/python ]] || python3 -m venv "$venv"
    py=$venv/bin/python
    "$py" -m pip install --quiet --upgrade pip
    # Exact pins: the public index only has empty placeholder wheels (torch-neuronx 1.0, ...)
    # under these names, and an exact version keeps pip from ever picking them. No torch-xla pin:
    # torch-neuronx requires the torch-xla it was built against (checked below).
    "$py" -m pip install --quiet --extra-index-url "$NT_REPO_PIP" \
        "torch==$NT_TORCH" "torchvision==$NT_TORCHVISION" \
        "torch-neuronx==$NT_TORCH_NEURONX" "neuronx-cc==$NT_NEURONX_CC" "libneuronxla==$NT_LIBNEURONXLA"
    check_torch_xla "$py"
    install_project "$py"
    check_torch_xla "$py"  # the project's install must have left torch-neuronx's choice in place
    ln -sf "$venv/bin/neuron-train" /usr/local/bin/neuron-train
}

# The project without its torch, torch-xla and torchvision pins (those are in place already; with
# them pip would replace torch-neuronx's torch-xla by the project's pin, with only a warning), then
# the project's other requirements as it declares them.
install_project() {
    local py=$1 reqs=()
    "$py" -m pip install --quiet --no-deps "$SRC_DIR"
    mapfile -t reqs < <("$py" - <<'PY'
import re
from importlib import metadata
for req in metadata.requires("neuron-train") or []:
    name = re.split(r"[\s<>=!~;\[(]", req, maxsplit=1)[0].lower().replace("_", "-")
    if "extra ==" not in req and name not in ("torch", "torch-xla", "torchvision"):
        print(req)
PY
    ) || die "cannot read neuron-train's requirements from $py"
    ((${#reqs[@]})) || die "neuron-train declares no requirements in $py: is $SRC_DIR the project?"
    "$py" -m pip install --quiet --extra-index-url "$NT_REPO_PIP" "${reqs[@]}"
}

# The torch-xla installed beside torch-neuronx: present, satisfying what torch-neuronx's metadata
# requires of it (importlib.metadata.requires: names with versions, unlike pip show), and of the
# minor release the project is built for (the minor of NT_TORCH_XLA). One line either way.
check_torch_xla() {
    local py=$1 said
    said=$("$py" - "$NT_TORCH_NEURONX" "$NT_TORCH_XLA" "$NT_NEURON_SDK" 2>&1 <<'PY'
import re, sys
from importlib import metadata
neuronx, pinned, sdk = sys.argv[1:]
try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
try:
    wanted = [r for r in metadata.requires("torch-neuronx") or []
              if re.split(r"[\s<>=!~;\[(]", r, maxsplit=1)[0].lower().replace("_", "-") == "torch-xla"]
except metadata.PackageNotFoundError:
    sys.exit(f"torch-neuronx is not installed in {sys.executable}")
spec = wanted[0].split(";")[0].strip() if wanted else "torch-xla (no version)"
try:
    have = metadata.version("torch-xla")
except metadata.PackageNotFoundError:
    sys.exit(f"torch-neuronx {neuronx} installed no torch-xla (it requires {spec}): check the Neuron pip "
             f"repository and the NT_NEURON_SDK release ({sdk})")
if wanted and not Requirement(spec).specifier.contains(have, prereleases=True):
    sys.exit(f"torch-xla {have} is installed but torch-neuronx {neuronx} requires {spec}: something replaced "
             "torch-neuronx's choice; reinstall it (pip install --force-reinstall torch-neuronx==...)")
if not have.startswith(pinned.rsplit(".", 1)[0] + "."):
    sys.exit(f"torch-neuronx {neuronx} brought torch-xla {have}, not {pinned.rsplit('.', 1)[0]}.x: pick an "
             f"NT_NEURON_SDK release built for this project's torch-xla {pinned}")
print(f"torch-neuronx {neuronx} requires {spec}; torch-xla {have} installed")
PY
    ) || die "${said:-torch-xla check failed in $py}"
    log "$said"
}

run_doctor() {
    local report strict=()
    report=/var/log/neuron-train-doctor-$(date +%Y%m%dT%H%M%S).json
    compgen -G '/dev/neuron[0-9]*' >/dev/null && strict=(--require-neuron)
    log "neuron-train doctor ${strict[*]} (report: $report)"
    PATH=/opt/aws/neuron/bin:$PATH "$NT_PREFIX/venv/bin/neuron-train" doctor "${strict[@]}" \
        --compile-cache "$NT_CACHE_DIR" --json "$report"
}

# One precompile per world size of NT_PREWARM_NPROCS (torchrun on this one node).
prewarm_cache() {
    local args=() n
    [[ -n ${NT_PREWARM_ARGS:-} ]] || return 0
    check_prewarm
    [[ -x $SRC_DIR/scripts/precompile.sh ]] || die "NT_PREWARM_ARGS is set but $SRC_DIR/scripts/precompile.sh is missing"
    read -r -a args <<<"$NT_PREWARM_ARGS"
    for n in $NT_PREWARM_NPROCS; do
        log "pre-warming $NT_CACHE_DIR for $n process(es) with: ${args[*]}"
        # As the training user: the cache then belongs to whoever trains from this image.
        sudo -u "$NT_USER" env PATH="$NT_PREFIX/venv/bin:/opt/aws/neuron/bin:$PATH" \
            "$SRC_DIR/scripts/precompile.sh" --compile-cache "$NT_CACHE_DIR" --nproc-per-node "$n" -- "${args[@]}"
    done
}

main() {
    parse_args "$@"
    check_platform
    TMP_DIR=$(mktemp -d)  # global: the EXIT trap runs after main's locals are gone
    trap 'rm -rf "$TMP_DIR"' EXIT
    local tmp=$TMP_DIR
    install_prerequisites
    fetch_source
    load_pins "$SRC_DIR/neuron_train/data/neuron_versions.json"
    log "Neuron SDK $NT_NEURON_SDK for $SRC_DIR"
    add_neuron_apt_repo "$tmp"
    install_neuron_packages
    install_efa "$tmp"
    configure_system
    install_python_env
    run_doctor
    prewarm_cache
    apt-get clean
    log "done: Neuron SDK $NT_NEURON_SDK, project in $NT_PREFIX, compile cache $NT_CACHE_DIR"
}

# Run when executed (also as user-data); when sourced (the tests), only define the functions.
if [[ ${BASH_SOURCE[0]} == "$0" ]]; then
    main "$@"
fi
