# Every target sets itself up from a clean clone: a .venv with CPU torch and qtool installed editable.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip
STAMP  := $(VENV)/.qtool-installed

.PHONY: setup test run bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -c constraints.txt torch==2.13.0
	$(PIP) install --quiet -c constraints.txt -e '.[hf,report,test]'
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q

run: $(STAMP)
	$(BIN)/python -m qtool.example

bench: $(STAMP)
	$(BIN)/python bench/run.py

clean:
	rm -rf $(VENV) build *.egg-info runs bench/results
