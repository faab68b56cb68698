# PyTorch reference files (test/data/ref_*.bin): `make reference`.
# Builds a venv in .venv-reference/ (once; redone when the requirements change), runs the
# reference self-check, then regenerates test/data/ref_a.bin ... ref_g.bin
# (deterministic: the same torch build gives byte-identical files; another torch build may
# differ from the checked-in files by a few float32 ulps, far inside test_reference's tolerances).
# torch comes from PyPI first; the CPU-wheel index is a fallback (often unreachable).
REF_VENV    := .venv-reference
REF_PYTHON  := $(REF_VENV)/bin/python
REF_STAMP   := $(REF_VENV)/.installed
REF_REQS    := scripts/requirements-reference.txt

$(REF_STAMP): $(REF_REQS)
	python3 -m venv $(REF_VENV)
	$(REF_PYTHON) -m pip install -r $(REF_REQS) || \
	  $(REF_PYTHON) -m pip install --index-url https://download.pytorch.org/whl/cpu torch
	touch $@

.PHONY: reference reference-selfcheck
reference: $(REF_STAMP)
	$(REF_PYTHON) scripts/reference.py --selfcheck
	$(REF_PYTHON) scripts/reference.py --out test/data

reference-selfcheck: $(REF_STAMP)
	$(REF_PYTHON) scripts/reference.py --selfcheck
