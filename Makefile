# make test: set up a virtual environment from nothing and run the test suite.
# make demo: train the default model (configs/digits_lenet.yaml) on the native backend with the bundled data.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test demo bench clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test,data,cli]"
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q tests

demo: $(STAMP)
	$(VENV)/bin/leafpy train configs/digits_lenet.yaml --backend native --out runs/demo

clean:
	rm -rf $(VENV) runs build *.egg-info
