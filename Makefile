# llm-ratelimit: `make help` lists the targets.
SHELL := /bin/bash
.DEFAULT_GOAL := help

WASM_TARGET := wasm32-unknown-unknown
WASM := target/$(WASM_TARGET)/wasm/llm_ratelimit.wasm
PY := .venv/bin/python

# A rustup wasm32 target where there is one; otherwise Debian's rustc-web, which must
# build std itself (RUSTC_BOOTSTRAP lets a stable compiler take -Zbuild-std).
ifeq ($(shell rustup target list --installed 2>/dev/null | grep -x $(WASM_TARGET)),$(WASM_TARGET))
WASM_CARGO := cargo
WASM_FLAGS :=
else
WASM_CARGO := RUSTC_BOOTSTRAP=1 RUSTC=/usr/bin/rustc /usr/bin/cargo
WASM_FLAGS := -Zbuild-std=std,panic_abort
endif

.PHONY: help setup build wasm empty-filter floor-filter request-bench-v8 native test test-under-load wasm-test fuzz fuzz-check unit integration up down demo bench soak faults accuracy capacity provider-bench fairness lint clean

help: ## List the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-12s %s\n", $$1, $$2}'

setup: ## Install what is missing (wasm toolchain, redis-server, wrk, Envoy and Python packages)
	@scripts/setup.sh

build: setup wasm native ## Build the filter (.wasm), the companion, the llm-ratelimit CLI and the mock upstream

wasm:
	$(WASM_CARGO) rustc -p llm-ratelimit --profile wasm --lib --crate-type cdylib --target $(WASM_TARGET) $(WASM_FLAGS)
	@ls -l $(WASM)

EMPTY_WASM := target/$(WASM_TARGET)/release/empty_filter.wasm

empty-filter: setup
	CARGO_TARGET_DIR=$(CURDIR)/target $(WASM_CARGO) build --release --manifest-path bench/empty-filter/Cargo.toml --target $(WASM_TARGET) $(WASM_FLAGS)

# The benchmark's ABI floor: the host calls of a leased token-aware request, no logic.
floor-filter: setup
	CARGO_TARGET_DIR=$(CURDIR)/target $(WASM_CARGO) build --release --manifest-path bench/floor-filter/Cargo.toml --target $(WASM_TARGET) $(WASM_FLAGS)

# request_bench's loop as a wasm module Node's V8 runs (scripts/bench_v8.py).
request-bench-v8:
	$(WASM_CARGO) build -p llm-ratelimit-core --example request_bench_v8 --features testing --profile wasm --target $(WASM_TARGET) $(WASM_FLAGS)

native:
	cargo build --release -p llm-ratelimit-companion -p mock-llm -p llm-ratelimit-cli

test: build ## Run every test: unit (native and wasm), Lua against Redis, companion, end to end through Envoy
	cargo test --workspace
	$(MAKE) --no-print-directory fuzz-check
	$(MAKE) --no-print-directory wasm-test
	$(PY) -m pytest tests -q -p no:cacheprovider

UNDER_LOAD_RUNS ?= 5
UNDER_LOAD_CMD ?= $(MAKE) --no-print-directory test

test-under-load: build ## make test UNDER_LOAD_RUNS times (5) with a busy loop on every core; the loops stopped by PID
	scripts/test_under_load.sh $(UNDER_LOAD_RUNS) $(UNDER_LOAD_CMD)

wasm-test: ## The unit tests marked for wasm, built for the filter's target and run under Node
	CARGO_TARGET_WASM32_UNKNOWN_UNKNOWN_RUNNER=wasm-bindgen-test-runner $(WASM_CARGO) test -p llm-ratelimit-core --lib --target $(WASM_TARGET) $(WASM_FLAGS)

unit: ## Native unit tests only
	cargo test --workspace

integration: build ## Python-driven tests only (Redis, companion, Envoy)
	$(PY) -m pytest tests -q -p no:cacheprovider

up: build ## Start the demo stack in the background (Envoy on 127.0.0.1:10000)
	$(PY) scripts/demo.py up

down: ## Stop the demo stack
	@if [ -x $(PY) ]; then $(PY) scripts/demo.py down; else echo "nothing to stop"; fi

demo: up ## Start the demo stack and send a short burst through it
	$(PY) scripts/demo.py burst

bench: build empty-filter floor-filter ## Measure Envoy without and with the filter in one run and print ratios
	cargo build --release -p llm-ratelimit-core --example tokenize_bench
	$(PY) scripts/bench.py

SOAK_KEYS ?= 1000000

soak: build ## Many tenants: a new API key per request through one Envoy, its memory after each phase
	$(PY) scripts/soak.py --keys $(SOAK_KEYS)

FAULT_MINUTES ?= 4

faults: build ## Fault suite under load (~6 min, not in make test): Redis restarted and paused, companion and an Envoy killed
	$(PY) scripts/faults --minutes $(FAULT_MINUTES)

accuracy: build ## Token limits against their budget when the upstream counts prompts its own way (~6 min, not in make test)
	$(PY) scripts/accuracy.py

provider-bench: build ## Requests that reached the provider only to be refused, without and with provider_limits (mock at 50% of the offered load, ~2 min, not in make test)
	$(PY) scripts/provider_bench.py

FAIRNESS_SECONDS ?= 180

fairness: build ## A pool of 10,000 TPM through 3 Envoys, one tenant offering 10x, nine 5% each: with and without fair_share (~7 min, not in make test)
	$(PY) scripts/fairness.py --cost
	$(PY) scripts/fairness.py --seconds $(FAIRNESS_SECONDS)

capacity: setup ## Redis memory per tenant for each kind of limit, and what one Redis shard sustains running the script (~3 min, not in make test)
	$(PY) scripts/capacity.py

FUZZ_SECONDS ?= 60
FUZZ_TARGETS := config request_body sse_stream json_reply event_stream json_array_stream body_differential provider_word

# fuzz/ is a workspace of its own (cargo-fuzz builds it with sanitizer flags), so the
# workspace's build never compiles it: this does, natively and without instrumentation
# (no nightly, no cargo-fuzz), and runs each target on FUZZ_CHECK_RUNS generated inputs.
FUZZ_CHECK_RUNS ?= 20000

fuzz-check: ## Compile every fuzz target and run each briefly (part of make test)
	@test "$$(grep -c '^\[\[bin\]\]' fuzz/Cargo.toml)" = "$(words $(FUZZ_TARGETS))" || { echo "fuzz/Cargo.toml and FUZZ_TARGETS list different targets"; exit 1; }
	cd fuzz && CARGO_TARGET_DIR=$(CURDIR)/target cargo build --bins
	@for target in $(FUZZ_TARGETS); do \
	  out=$$(target/debug/$$target -runs=$(FUZZ_CHECK_RUNS) -seed=1 -max_len=4096 -artifact_prefix=target/fuzz-check- 2>&1) \
	    || { echo "$$out" | tail -40; echo "fuzz-check: $$target failed"; exit 1; }; \
	  echo "fuzz-check: $$target: $$(echo "$$out" | tail -1)"; \
	done

fuzz: ## Run each cargo-fuzz target for FUZZ_SECONDS (default 60)
	@command -v cargo-fuzz >/dev/null || cargo install --quiet cargo-fuzz --version 0.13.2
	@for target in $(FUZZ_TARGETS); do \
	  echo "fuzz: $$target for $(FUZZ_SECONDS)s"; \
	  (cd fuzz && RUSTC_BOOTSTRAP=1 cargo fuzz run $$target -- -max_total_time=$(FUZZ_SECONDS) -rss_limit_mb=4096) || exit 1; \
	done

lint: ## rustfmt, clippy (native) and the core's layers (no import cycle)
	cargo fmt --all -- --check
	$(PY) scripts/check_layers.py
	cargo clippy --workspace --all-targets -- -D warnings

clean: down ## Remove build output and the demo's run directory
	rm -rf target run
