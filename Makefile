# Every target sets up .venv first, so each works on a fresh clone.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: venv demo test proto lint wheel bench clean

$(BIN)/pstrain: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

venv: $(BIN)/pstrain

demo: venv  ## the main job: train the digits MLP on a localhost cluster
	$(BIN)/pstrain local --config examples/digits.yaml --out runs/digits

test: venv  ## the whole test suite
	$(BIN)/python -m pytest -q

proto: venv  ## regenerate protos/pstrain_pb2*.py from protos/pstrain.proto
	$(BIN)/python -m pstrain.protos.codegen

lint: venv  ## ruff, mypy over every pstrain package (see .ci/typecheck.py), ansible-lint
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python .ci/typecheck.py
	cd ansible && ../$(BIN)/ansible-lint site.yml

# A stale build/ would put modules that no longer exist into the wheel, so it goes first.
wheel: venv  ## dist/pstrain-<version>-py3-none-any.whl: for `pip install` or Ansible's pstrain_wheel
	rm -rf build
	$(BIN)/pip wheel -q --no-deps --no-build-isolation -w dist .

bench: venv
	$(BIN)/python bench/pushpull.py

clean:
	rm -rf $(VENV) runs build dist *.egg-info
