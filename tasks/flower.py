"""Celery entry point for Flower: `celery -A tasks.flower flower`.

The workers' own app (tasks.worker), on kombu's plain Redis transport. The workers' transport
(tasks.hop.broker) names itself `tasks.hop.broker:Transport` in the broker URL Flower reads, and Flower's Broker
tab knows brokers by that URL's scheme: it answered 404 ("'redis' broker is not supported"). Flower
publishes no task and holds no message, which is all tasks.hop.broker changes, so kombu's own serves it; the
queues it lists are the same keys (global_keyprefix is read from the same transport options). Flower 1's
/dashboard, which older links name, goes to the workers page.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from types import FrameType

from tornado.web import RedirectHandler

from contract.settings.check_secrets import problems


def refuse_weak_credentials(environ: dict[str, str]) -> None:
    """Flower never starts without its basic auth, nor with an empty, placeholder or short password (its task
    list names every tenant's jobs, and it can apply tasks): a copied .env.example's `admin:` opened it to anyone
    who typed `admin` and nothing else. Checked here, in Flower's own process, whoever starts it."""
    if not environ.get("FLOWER_BASIC_AUTH"):
        found = ["FLOWER_BASIC_AUTH is not set (user:password; make run makes one in var/flower-credentials)"]
    else:
        found = problems(["FLOWER_BASIC_AUTH"], environ)
    for problem in found:
        print(f"flower: refusing to start: {problem}", file=sys.stderr, flush=True)
    if found:
        raise SystemExit(1)


refuse_weak_credentials(dict(os.environ))

from contract.runtime.logs import configure_logging  # noqa: E402
from tasks.worker import app, settings  # noqa: E402 (Flower refuses to start before the workers' app is built)

# Flower's lines as every process's (tornado adds its own handler only where the root logger has none), and of its
# start-up banner only the address unless logs.verbose.
configure_logging("flower", settings.logs)


class _OnlyTheAddress(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return str(record.msg).startswith("Visit me at")


if not settings.logs.verbose:
    logging.getLogger("flower.command").addFilter(_OnlyTheAddress())

app.conf.broker_transport = None  # the scheme of broker_url (redis://) picks kombu's own transport


def _keep_old_links() -> None:
    """Flower 1's /dashboard is Flower 2's workers page: links and bookmarks to it answered 404. Added to Flower's
    own routes before its catch-all, when this module is loaded (`-A tasks.flower`, before Flower builds its
    application from that list)."""
    from flower import urls

    if not any(route[0] == r"/dashboard/?" for route in urls.handlers if isinstance(route, tuple)):
        urls.handlers.insert(len(urls.handlers) - 1, (r"/dashboard/?", RedirectHandler, {"url": "/workers"}))


def _authenticate_every_route() -> None:
    """Flower serves /metrics (every task's counts by name and worker) and /healthcheck without asking for its
    credentials: their handlers lack the authentication every other view has. Every route of Flower's own
    handlers is put behind it here, but the login and logout pages (OAuth's way in) and its static files
    (Flower's own scripts and styles, the same in every install). An unknown path is a 401 too, not a 404 that
    tells routes apart."""
    from flower import urls
    from flower.views import BaseHandler
    from flower.views.auth import LoginHandler, LogoutHandler

    for index, route in enumerate(urls.handlers):
        handler = route[1] if isinstance(route, tuple) else route.handler_class
        if not issubclass(handler, BaseHandler) or issubclass(handler, (LoginHandler, LogoutHandler)):
            continue
        guarded = _guarded(handler)
        if guarded is handler:
            continue
        if isinstance(route, tuple):
            urls.handlers[index] = (route[0], guarded, *route[2:])
        else:
            route.handler_class = guarded


def _guarded(handler: type) -> type:
    """`handler`, or a subclass whose HTTP methods without tornado's `authenticated` have it."""
    from tornado.web import authenticated

    open_methods = {
        name: method
        for name in ("get", "head", "post", "put", "patch", "delete")
        if (method := getattr(handler, name, None)) is not None
        and not hasattr(method, "__wrapped__")  # authenticated wraps with functools.wraps
        and getattr(method, "__qualname__", "").split(".")[0] != "RequestHandler"  # tornado's own 405
    }
    if not open_methods:
        return handler
    return type(handler.__name__, (handler,), {name: authenticated(method) for name, method in open_methods.items()})


STOP_WITHIN_S = 3.0


def _bound_the_stop() -> None:
    """Flower's SIGTERM handler ends the interpreter, which first waits for its thread pool: a job publishing to a
    broker that does not answer (Redis stopped or failing over) retries forever inside kombu, so the stop needed
    SIGKILL. Flower keeps nothing to save here (no --persistent): past STOP_WITHIN_S it ends anyway, with 0,
    saying why. Flower's command looks its handler up when it installs it, after this module is loaded."""
    from flower import command

    flowers_own = command.sigterm_handler

    def stop_within_bound(signum: int, frame: FrameType | None) -> None:
        def end_now() -> None:
            logging.getLogger("flower").warning(
                "still stopping %g s after SIGTERM (a thread waits on the broker): ending now", STOP_WITHIN_S
            )
            os._exit(0)

        timer = threading.Timer(STOP_WITHIN_S, end_now)
        timer.daemon = True
        timer.start()
        flowers_own(signum, frame)

    command.sigterm_handler = stop_within_bound


_keep_old_links()
_authenticate_every_route()
_bound_the_stop()

__all__ = ["app"]
