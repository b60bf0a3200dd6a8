#!/usr/bin/env bash
# Install what the ARM (aarch64) tests need on a Debian/Ubuntu x86-64 host: the cross
# compilers and C library (gcc/g++-aarch64-linux-gnu, libc6-dev-arm64-cross: link kernel.so,
# libmha.so and the C app) and qemu-user (qemu-aarch64 runs them). The aarch64 TVM runtime
# itself comes from PyPI into mhagen's cache (python -m mhagen.artifact.other_arch fetch; the tests do it).
set -euo pipefail
PACKAGES=(gcc-aarch64-linux-gnu g++-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user)
if command -v aarch64-linux-gnu-g++ >/dev/null && command -v aarch64-linux-gnu-gcc >/dev/null \
    && command -v qemu-aarch64 >/dev/null && [ -d /usr/aarch64-linux-gnu/lib ]; then
  echo "setup-arm: cross toolchain and qemu already installed"
  exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}"
aarch64-linux-gnu-g++ --version | head -1
qemu-aarch64 --version | head -1
