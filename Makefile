.PHONY: run test test-fast test-inductor test-soak test-chaos lint docs docs-serve bootstrap compose-check compose-test peer

run:          ## install what is needed, then run the whole service locally (VERBOSE=1: the start-up banners too; CELLS=2: two cells behind one API; CACHE_REDIS=1: the result cache on a Redis of its own)
	@scripts/run-local

test:         ## install what the tests need, then run them
	scripts/test

test-fast:    ## the inner loop: every test that starts no Redis, Celery, GPU-worker or gunicorn process
	scripts/test -m "not integration and not gpu and not slow" -q

test-inductor: ## torch.compile with Inductor on the CPU against the eager forward (~100 s of CPU; make test compiles with aot_eager)
	scripts/test -m inductor tests/test_gpu_accelerated.py

test-soak:    ## five minutes of steady load on make run's stack: no process may grow past its bound (tests/test_soak.py)
	scripts/test -m soak

test-chaos:   ## every partition, dead-host and clock scenario on several hosts (network namespaces; root): ~25 minutes
	TEST_WORKERS=1 scripts/test -m chaos

lint:         ## install what the checks need, then lint and format-check (ruff), type-check (mypy; strict on contract/), build the docs
	scripts/bootstrap --dev
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	.venv/bin/mypy
# not --quiet: it hides mkdocs' warnings from its own strict count, and the build passed on them
	NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict

docs:         ## build the docs site into var/site (mkdocs build --strict): open var/site/index.html, or make docs-serve
	scripts/bootstrap --dev
	NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict

docs-serve:   ## the docs site, rebuilt as you edit, at http://127.0.0.1:8001 (mkdocs.yml's dev_addr: not the API's 8000)
	scripts/bootstrap --dev
	NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs serve

bootstrap:
	scripts/bootstrap --dev

peer:         ## install issue 43's peer (LitServe 0.2.19) into .peer/, apart from the service's packages, for `bench peer`
	scripts/bootstrap --dev
	.venv/bin/pip install --quiet --target .peer "litserve==0.2.19" "python-multipart"

compose-check:
	docker-compose config -q

compose-test: ## build and run the compose stack on this machine (Docker; local stand-in images), prove it, tear it down
	scripts/compose-test
