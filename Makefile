# The two commands in the README are `make demo` and `make test`; everything they need
# (the Python environment, the control-plane binaries) is installed or built on the way.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha256sum | cut -c1-12)

.PHONY: policy setup cluster-build node-setup node-build image-build helm-build cluster-up cluster-down demo test test-versions test-unit test-integration test-node test-hardware h200-carry lint bench protos

$(STAMP): pyproject.toml
	@echo "[setup] creating $(VENV) and installing the driver with its test extras"
	@test -x $(PY) || python3 -m venv $(VENV)
	@$(PY) -m pip install -q --upgrade pip
	@$(PY) -m pip install -q -e '.[test]'
	@rm -f $(VENV)/.installed-*; touch $@

setup: $(STAMP)

cluster-build:
	@bash hack/cluster/build.sh >/dev/null

# A real node: Debian's runc, CNI plugins, catatonit, busybox-static (apt-get), then the
# kubelet and containerd built into a cache outside the repository.
node-setup:
	@bash hack/node/setup.sh

node-build: node-setup
	@bash hack/node/build.sh >/dev/null

# The driver's image from the Dockerfile (buildah; Debian base stand-in made once) and Helm
# v4 from the Go module proxy, both cached outside the repository by their inputs.
image-build:
	@bash hack/image/build.sh >/dev/null

helm-build:
	@bash hack/helm/build.sh >/dev/null

cluster-up: setup cluster-build
	@$(PY) -m tests.harness.cluster up

cluster-down: setup
	@$(PY) -m tests.harness.cluster down

demo: setup cluster-build node-build
	@$(PY) -m demo.run $(DEMO_ARGS)

# The chart's claim-config admission policy, generated from the rules table the node's parser
# runs (dra_driver/sharing/rules.py); tests/unit/test_claim_policy_generated.py checks it is current.
policy: setup
	@$(PY) -m dra_driver.sharing.policy_cel --write

lint: setup
	@$(VENV)/bin/ruff check dra_driver controller tests hack benchmarks demo
	@$(VENV)/bin/mypy

test: setup cluster-build node-build image-build helm-build lint
	@$(VENV)/bin/pytest -q -ra tests

# The version matrix (docs/install.md): builds the control plane of 1.34, 1.35, 1.36 and 1.37
# (cached per version; a cold build of one is tens of minutes) and runs the version tests on
# each with its default gates and with its DRA gates on; prints the table. Outside CI's budget.
test-versions: setup helm-build
	@$(PY) -m tests.harness.versions $(if $(VERSIONS),--versions $(VERSIONS)) $(if $(NO_NODE),--no-node)

test-unit: setup
	@$(VENV)/bin/pytest -q -ra tests/unit

test-integration: setup cluster-build
	@$(VENV)/bin/pytest -q -ra tests/integration

test-node: setup cluster-build node-build image-build helm-build
	@$(VENV)/bin/pytest -q -ra tests/node

test-hardware: setup
	@$(VENV)/bin/pytest -q -ra tests/hardware

# What one device call carries to the GPU host for tests/hardware/test_hw_pod.py (.h200/,
# under 64 MiB); there, `bash hack/h200/run.sh` runs it (hack/h200/run.sh says how).
h200-carry:
	@bash hack/h200/build.sh >/dev/null

# `make bench` runs every benchmark with a small fleet (minutes); `make bench FULL=1` runs the
# slices and scheduler benchmarks at fleet scale (5,000 nodes' slices; 500 nodes, 5,000 pods).
bench: setup cluster-build
	@$(PY) -m benchmarks.run $(if $(FULL),--full)

protos: setup
	@$(PY) hack/gen-protos.py
