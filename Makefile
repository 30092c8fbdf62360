.PHONY: run test lint bootstrap compose-check

run:          ## install what is needed, then run the whole service locally
	scripts/run-local

test:         ## install what the tests need, then run them
	scripts/test

lint:         ## install what the checks need, then lint (ruff: pycodestyle, pyflakes, import order)
	scripts/bootstrap --dev
	.venv/bin/ruff check .

bootstrap:
	scripts/bootstrap --dev

compose-check:
	docker-compose config -q
