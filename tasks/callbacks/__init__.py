"""A job's callback: the attempt and where the job waits next (delivery.py), its POST (http_client.py), the outbox
handed to Celery (relay.py) and how many attempts a tenant may have in flight (slots.py)."""
