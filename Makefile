# The two commands of the README: `make lab` and `make test`.
VENV   ?= .venv
PYTHON ?= python3
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.pipelab-installed

.PHONY: lab demo test screenshots student-copy install clean

lab: $(STAMP)          ## open the course in JupyterLab (headless machines: `make demo`)
	$(VENV)/bin/pipelab lab

demo: $(STAMP)         ## a headless demo: one pipelined training run, table + timeline PNG
	$(VENV)/bin/pipelab run --model mlp --stages 4 --microbatches 8 --schedule 1f1b --steps 20

test: $(STAMP)         ## every test: engine, graders (solutions, stubs, mutants), notebooks
	$(PY) -m pytest

screenshots: $(STAMP)  ## the README's screenshots (docs/*.png), by the browser test (needs Chromium)
	PIPELAB_SCREENSHOTS=docs $(PY) -m pytest tests/test_browser.py -p no:cacheprovider

student-copy: $(STAMP) ## the course without solutions/ or the graders' own tests, for students: make student-copy DIR=../pipelab-student
	@test -n "$(DIR)" || { echo "usage: make student-copy DIR=../pipelab-student"; exit 2; }
	$(PY) -m pipelab.course.student_copy "$(DIR)"

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

clean:
	rm -rf $(VENV) pipelab-out .pytest_cache
