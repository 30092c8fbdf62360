.PHONY: run test bootstrap compose-check

run:          ## install what is needed, then run the whole service locally
	scripts/run-local

test:         ## install what the tests need, then run them
	scripts/test

bootstrap:
	scripts/bootstrap --dev

compose-check:
	docker-compose config -q
