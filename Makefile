# make test: set up a virtual environment from nothing and run the test suite (on two pytest-xdist workers).
# make demo: train the default model (configs/digits_lenet.yaml) on the native backend with the bundled data.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test demo vulkan browser bench web-peers web-bench dist docs clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test,data,cli,webgpu,dist,docs]"
	touch $(STAMP)

# webgpu tests run on Mesa's CPU Vulkan driver (lavapipe) where no GPU exists
vulkan:
	@if [ -z "$$(ls /usr/share/vulkan/icd.d 2>/dev/null)" ] || ! ldconfig -p | grep -q libvulkan.so.1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing mesa-vulkan-drivers and libvulkan1 for the webgpu tests"; \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mesa-vulkan-drivers libvulkan1 >/dev/null) \
	      || echo "could not install the Vulkan driver: the webgpu tests will skip"; \
	  else \
	    echo "no Vulkan driver and no root: the webgpu tests will skip (install mesa-vulkan-drivers libvulkan1)"; \
	  fi; \
	fi

# the browser tests (-m browser) compile the WGSL in headless Chromium, whose WebGPU runs on SwiftShader
browser:
	@if ! command -v chromium >/dev/null; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing chromium for the browser tests"; \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
	      || echo "could not install chromium: the browser tests will skip"; \
	  else \
	    echo "no chromium and no root: the browser tests will skip (install Debian's chromium)"; \
	  fi; \
	fi

test: $(STAMP) vulkan browser
	$(PY) -m mypy
	$(PY) -m pytest -q -n 2 --durations=25 tests

demo: $(STAMP)
	$(VENV)/bin/leafpy train configs/digits_lenet.yaml --backend native --out runs/demo --overwrite

bench: $(STAMP)
	$(PY) -m pip install -q "torch==2.13.0" "threadpoolctl>=3"
	$(PY) benchmarks/train_step.py --backend native --vs torch

# make web-peers: the npm packages of the browser benchmark (TensorFlow.js, onnxruntime-web, pinned in
# benchmarks/web/package-lock.json) into benchmarks/web/node_modules, and nowhere else; make test never runs npm.
# make web-bench: then leafpy.js against them in headless Chromium (benchmarks/web_inference.py)
WEB_PEERS := benchmarks/web/node_modules/.package-lock.json

$(WEB_PEERS): benchmarks/web/package-lock.json
	cd benchmarks/web && npm ci --no-audit --no-fund

web-peers: $(WEB_PEERS)

web-bench: $(STAMP) browser $(WEB_PEERS)
	$(PY) benchmarks/web_inference.py

# make dist: the sdist and wheel in dist/, their metadata checked (what a release uploads)
dist: $(STAMP)
	$(PY) -m pip install -q "build>=1.2" "twine>=5"
	rm -rf dist
	$(PY) -m build --outdir dist .
	$(PY) -m twine check --strict dist/*

# make docs: the documentation site (README as home page, docs/, API reference) in site/
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict -d site

clean:
	rm -rf $(VENV) runs build dist site *.egg-info
