# Python tools (scripts/requirements-tools.txt): a venv in .venv-tools/, built once and again when
# the requirements change; `make test` builds it and runs test/test_python.sh with it.
TOOLS_VENV   := .venv-tools
TOOLS_PYTHON := $(TOOLS_VENV)/bin/python
TOOLS_STAMP  := $(TOOLS_VENV)/.installed
TOOLS_REQS   := scripts/requirements-tools.txt

$(TOOLS_STAMP): $(TOOLS_REQS)
	python3 -m venv $(TOOLS_VENV)
	$(TOOLS_PYTHON) -m pip install -q --disable-pip-version-check -r $(TOOLS_REQS)
	touch $@

# our engine's logits for a token row from a checkpoint (scripts/compare_hf.py, test/test_python.sh)
dev/bin/forward_logits: dev/forward_logits.cpp train_gpt.cu $(HEADERS)
	@mkdir -p dev/bin
	$(CXX) $(CXXFLAGS) dev/forward_logits.cpp -o $@

.PHONY: tools test_python
tools: $(TOOLS_STAMP)

test_python: $(TOOLS_STAMP) train_gpt_cpu dev/bin/forward_logits
	TOOLS_PYTHON=$(TOOLS_PYTHON) bash test/test_python.sh
