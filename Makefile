.PHONY: run test test-fast lint bootstrap compose-check

run:          ## install what is needed, then run the whole service locally
	scripts/run-local

test:         ## install what the tests need, then run them
	scripts/test

test-fast:    ## the inner loop: every test that starts no Redis, Celery, GPU-worker or gunicorn process
	scripts/test -m "not integration and not gpu" -q

lint:         ## install what the checks need, then lint (ruff) and type-check (mypy; strict on contract/)
	scripts/bootstrap --dev
	.venv/bin/ruff check .
	.venv/bin/mypy

bootstrap:
	scripts/bootstrap --dev

compose-check:
	docker-compose config -q
