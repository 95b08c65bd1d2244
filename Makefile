# Every target sets itself up: a fresh machine needs only python3 (3.10+) and make.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch is installed first and pinned by constraints.txt, so no other package can pull a
# different (multi-GB) build. Override on other platforms, e.g. a Jetson's NVIDIA wheels.
TORCH ?= torch==2.14.1 torchvision==0.29.1

.PHONY: setup demo test lint proto bench bench-fedsap bench-pfedka clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	touch $@

# A real fl-server and 4 fl-edge processes on loopback, on the bundled MNIST subset.
demo: setup
	OMP_NUM_THREADS=1 $(VENV)/bin/fl-demo --method fedsap --edges 4 --rounds 5 --alpha 0.5 \
		--out runs/demo --force

test: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -p no:cacheprovider

lint: setup
	$(VENV)/bin/ruff check .

# Regenerates shared/wire/fedattn_pb2*.py from proto/ (tests/test_proto_current.py fails when stale).
proto: setup
	$(PY) scripts/gen_proto.py

clean:
	rm -rf $(VENV) runs .pytest_cache

# Figures, printed not asserted (takes a few minutes).
bench: setup
	OMP_NUM_THREADS=1 $(PY) bench/wire.py

# Fed-SAP vs the baselines on CIFAR-10 from ../shared/data (about 35 min on 2 cores).
bench-fedsap: setup
	OMP_NUM_THREADS=1 $(PY) bench/fedsap.py

# pFedKA vs the baselines and its ablations on CIFAR-10 from ../shared/data (about 35 min on
# 2 idle cores; several hours on a busy shared machine), traffic and step time.
bench-pfedka: setup
	OMP_NUM_THREADS=1 $(PY) bench/pfedka.py
