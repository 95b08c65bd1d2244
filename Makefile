# Every target sets itself up: a fresh machine needs only python3 (3.10+) and make.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch is installed first and pinned by the constraints file, so no other package can pull
# a different (multi-GB) build. Other platforms (docs/operations.md, Edge devices):
#   x86 with a CUDA 12 driver: make setup CONSTRAINTS=deploy/constraints/cuda12.txt
#   Jetson (JetPack 6), beside NVIDIA's torch installed system-wide:
#     make setup CONSTRAINTS=deploy/constraints/jetpack6.txt TORCH= VENV_FLAGS=--system-site-packages
CONSTRAINTS ?= constraints.txt
TORCH ?= torch torchvision
VENV_FLAGS ?=

.PHONY: setup demo test test-links test-py310 lint proto docs reference bench bench-fedsap bench-anfr bench-feature-shift bench-fedstar bench-pfedka bench-load bench-secagg bench-dp clean

setup: $(VENV)/.installed

# --no-cache-dir: the venv alone is ~6 GB on x86 (torch's CUDA libraries), and a CI disk
# has run out of space during this install; pip keeps no second copy of its downloads.
$(VENV)/.installed: pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV_FLAGS) $(VENV)
	$(if $(strip $(TORCH)),$(PY) -m pip install -q --no-cache-dir -c $(CONSTRAINTS) $(TORCH))
	$(PY) -m pip install -q --no-cache-dir -c $(CONSTRAINTS) -e '.[test,server]'
	touch $@

# The ray extra (fl-sim --ray; ~80 MB download, ~240 MB installed, ~10 s) for
# tests/test_ray_sim.py, which starts a two-node Ray cluster on loopback. make test installs
# it; make setup, run on every machine of a deployment, does not.
$(VENV)/.ray: $(VENV)/.installed
	$(PY) -m pip install -q --no-cache-dir -c $(CONSTRAINTS) -e '.[test,server,ray]'
	touch $@

# A real fl-server and 4 fl-edge processes on loopback, on the bundled MNIST subset.
demo: setup
	OMP_NUM_THREADS=1 $(VENV)/bin/fl-demo --method fedsap --edges 4 --rounds 5 --alpha 0.5 \
		--out runs/demo --force

# --durations: the slowest tests close the log, so a suite over its ~15 min aim shows
# where the minutes went. TEST_WORKERS=N runs it in N pytest-xdist processes, a test file
# to each (its module fixtures built once), for machines with cores to spare. CI stays
# serial: on its 2 cores 3 workers took 22 min against 32, but each CPU-bound case ran up
# to 4x slower, nearer its timeout.
TEST_WORKERS ?= 1
test: setup $(VENV)/.ray
	@# tests/test_proxy.py runs the daemons through nginx: installed where root can (CI).
	@command -v nginx >/dev/null || test -x /usr/sbin/nginx || [ "$$(id -u)" != 0 ] || \
		(apt-get update -qq && apt-get install -y -qq nginx-light) || \
		echo "nginx-light not installed: tests/test_proxy.py will skip"
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -p no:cacheprovider -m "not links" --durations=30 \
		$(if $(filter-out 1,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile)

# Real daemons over shaped links in network namespaces (tests/test_links.py) and through
# nginx with a 60 s idle timeout for ten minutes (tests/test_proxy.py): minutes per test,
# so not in make test. Root; installs Debian's iptables (the loss) and nginx-light (the
# proxy) when missing.
test-links: setup
	command -v iptables >/dev/null || (apt-get update -qq && apt-get install -y -qq iptables)
	command -v nginx >/dev/null || test -x /usr/sbin/nginx || \
		(apt-get update -qq && apt-get install -y -qq nginx-light)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -p no:cacheprovider -m links tests/test_links.py \
		tests/test_proxy.py

# The unit tier on Python 3.10 (JetPack 6's) with the oldest stack pyproject.toml claims
# (deploy/constraints/oldest.txt: torch 2.4.1, torchvision 0.19.1, opacus 1.5.4, NumPy 1.x),
# in a second venv. Not part of `make test` or CI: it downloads ~3 GB (PyPI's torch 2.3.1
# is a CUDA build) and takes tens of minutes on 2 cores. Run it when a floor moves.
# the first python3.10 that runs: on PATH, else pyenv's (whose shim exists but may be inactive)
PYTHON310 ?= $(shell for p in python3.10 $(HOME)/.pyenv/versions/3.10*/bin/python3.10; do \
	"$$p" -c '' 2>/dev/null && { echo "$$p"; break; }; done)
VENV310 ?= .venv-py310
$(VENV310)/.installed: pyproject.toml deploy/constraints/oldest.txt
	$(PYTHON310) -m venv $(VENV310)
	$(VENV310)/bin/python -m pip install -q --no-cache-dir -c deploy/constraints/oldest.txt torch torchvision
	$(VENV310)/bin/python -m pip install -q --no-cache-dir -c deploy/constraints/oldest.txt -e '.[test,server]'
	touch $@

test-py310: $(VENV310)/.installed
	OMP_NUM_THREADS=1 $(VENV310)/bin/python -m pytest -q -p no:cacheprovider -m 'not slow and not ray'

lint: setup
	$(VENV)/bin/ruff check .

# Regenerates shared/wire/fedattn_pb2*.py from proto/ (tests/test_proto_current.py fails when stale).
proto: setup
	$(PY) scripts/gen_proto.py

# The documentation site, built strictly into site/ (tests/test_docs.py builds it too).
docs: setup
	$(VENV)/bin/mkdocs build --strict -d site

# Regenerates the generated parts of docs/ (CLI, config keys, method parameters) from the
# code; tests/test_docs.py fails when the committed pages are stale.
reference: setup
	$(PY) -m fl_tools.docs

clean:
	rm -rf $(VENV) runs .pytest_cache site

# Figures, printed not asserted (takes a few minutes).
bench: setup
	OMP_NUM_THREADS=1 $(PY) bench/wire.py

# Fed-SAP vs the baselines on CIFAR-10 from ../shared/data (about 35 min on 2 cores).
bench-fedsap: setup
	OMP_NUM_THREADS=1 $(PY) bench/fedsap.py

# ANFR vs BN/GN/SE/NF-ResNet under five aggregators, label skew on CIFAR-10 from ../shared/data
# (90 runs of compact models, 2-3.5 min each on the shared 2-core machine: several hours;
# --methods fedavg --schemes shards is the 15-run headline row, about 40 min).
bench-anfr: setup
	OMP_NUM_THREADS=1 $(PY) bench/anfr.py
# pFedLA's Table 1 on feature-shifted digits (5 hosts x 5 attention settings x 3 seeds:
# 75 federations; hours on 2 shared cores, `--hosts fedavg fedbn` for the core comparison).
bench-feature-shift: setup
	OMP_NUM_THREADS=1 $(PY) bench/feature_shift.py
# FedSTAR, its ablation and FedProto vs FedAvg / Ditto on MNIST and CIFAR-10, Dirichlet 0.1,
# 20 edges at 30 % per round, 3 seeds (CPU protocol; --full is the paper's, for a GPU).
bench-fedstar: setup
	OMP_NUM_THREADS=1 $(PY) bench/fedstar.py
# pFedKA vs the baselines and its ablations on CIFAR-10 from ../shared/data (about 35 min on
# 2 idle cores; several hours on a busy shared machine), traffic and step time.
bench-pfedka: setup
	OMP_NUM_THREADS=1 $(PY) bench/pfedka.py
# One fl-server and 100 / 300 fl-sim edges on loopback (lenet-bn), then a soak with random
# edge and server kills (about 15 min on 2 idle cores; --full adds 1000 edges).
bench-load: setup
	OMP_NUM_THREADS=1 $(PY) bench/load.py
# SecAgg+ (sparse and full graph) vs plain FedAvg: per-edge CPU and bytes, phase and unmask
# times, 8/32/100 edges, 0 and 10 % dropouts, MobileNetV3-small (1.53 M parameters).
bench-secagg: setup
	OMP_NUM_THREADS=1 $(PY) bench/secagg.py --out bench/results/secagg-$$(date +%F).txt
# DP-SGD: GN-ResNet vs compact ANFR at epsilon inf / 1 / 8 on CIFAR-10 from ../shared/data,
# accuracy and DP step-time overhead (6 federations; about 30 min on a busy 2-core machine).
bench-dp: setup
	OMP_NUM_THREADS=1 $(PY) bench/dp.py
