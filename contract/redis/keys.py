"""Every Redis key and channel the service uses, in one place.

Celery's own keys (its queues `preprocess` and `callbacks`, its workers' holds,
its bindings) live beside these in the same Redis, under `celery_prefix`, so two
deployments with different namespaces never share work; past the prefix they
are Celery's to name.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# Celery's queue for CPU work; its Redis transport keeps the queue as a list of this name.
PREPROCESS_QUEUE = "preprocess"
CALLBACK_QUEUE = "callbacks"
UPLOAD_SUFFIX = ":upload"  # a job's upload is its key plus this (the Lua that ends a job deletes it so)
CELERY_HOLDS = "holds:"  # + a worker process's id: the messages it holds, under Celery's key prefix
CELERY_HELD = "held:"  # + a worker process's id: the messages its takes moved into its held list (tasks.hop.broker)
KEY_WAITING_SEPARATOR = ":"  # an API key's waiting bytes: waiting_bytes, this, its id (the Lua that ends jobs too)
ANSWER_DEBT_SUFFIX = ":debt"  # a key's answer bucket in debt: the bucket's name and this (its Lua's DEBT_SUFFIX too)


@dataclass(frozen=True)
class Keys:
    namespace: str = "imgserve"

    @property
    def celery_prefix(self) -> str:
        """Prefix of every key Celery's Redis transport uses (its `global_keyprefix`)."""
        return f"{self.namespace}:celery:"

    def celery_queue(self, queue: str) -> str:
        """List: a Celery queue as it lies in Redis."""
        return self.celery_prefix + queue

    def celery_holds(self, holder: str) -> str:
        """Hash: delivery tag -> a Celery message one worker process holds and when it was delivered
        (tasks.hop.broker), given back to its queue at once when that worker is found dead (tasks.hop.recovery)."""
        return self.celery_prefix + CELERY_HOLDS + holder

    def celery_held(self, holder: str) -> str:
        """List: the Celery messages one worker process's takes moved off their queues (LMOVE, tasks.hop.broker), as
        they lay there; each goes at its ack (LREM), or back to its queue when that worker is found dead."""
        return self.celery_prefix + CELERY_HELD + holder

    @property
    def cpu_autoscalers(self) -> str:
        """Sorted set: the CPU worker nodes whose pool autoscales on the backlog (tasks.hop.autoscale), scored by their
        last look: the wanted processes are shared among those that looked recently."""
        return f"{self.namespace}:cpu_autoscalers"

    def cpu_heartbeat(self, holder: str) -> str:
        """String with a TTL: a Celery worker process (CPU or callback worker) while it lives."""
        return f"{self.namespace}:cpu:{holder}:heartbeat"

    @property
    def cpu_tenants(self) -> str:
        """Hash: API key id -> when a CPU worker last said (its heartbeat) that it takes that key's own
        queues. The API queues a key's jobs on them only while one does, else on the shared ones."""
        return f"{self.namespace}:cpu_tenants"

    def cpu_reaping(self, holder: str) -> str:
        """String with a TTL: a worker giving back a dead worker's messages (one at a time per dead worker)."""
        return f"{self.namespace}:cpu:{holder}:reaping"

    @property
    def lost_deliveries_lock(self) -> str:
        """String with a TTL: a worker looking for jobs whose task was lost in delivery (tasks.hop.lost_deliveries)."""
        return f"{self.namespace}:lost_deliveries:lock"

    @property
    def lost_deliveries_suspects(self) -> str:
        """Sorted set: queued jobs whose task the last look found nowhere, scored by when
        (tasks.hop.lost_deliveries)."""
        return f"{self.namespace}:lost_deliveries:suspects"

    @property
    def cpu_workers(self) -> str:
        """Sorted set: Celery worker processes (holders) scored by when they last said they live."""
        return f"{self.namespace}:cpu_workers"

    @property
    def waiting_bytes(self) -> str:
        """Hash: bytes of uploads and frames waiting in Redis, a field per model and `*` for all
        (contract.admission.budget)."""
        return f"{self.namespace}:waiting_bytes"

    def key_waiting_bytes(self, owner: str) -> str:
        """Hash: bytes of API key `owner`'s uploads waiting in Redis, a field per model (contract.admission.budget; its
        Lua names it the same way, from waiting_bytes)."""
        return f"{self.waiting_bytes}{KEY_WAITING_SEPARATOR}{owner}"

    @property
    def decode_share(self) -> str:
        """Hash: job id -> "key|bytes|lapse": an expensive upload's decode charged to its API key until its CPU
        stage ends or the charge lapses (contract.admission.decode_share)."""
        return f"{self.namespace}:decode_share"

    @property
    def deadlines(self) -> str:
        """Sorted set: live jobs scored by their deadline (epoch seconds), for the sweeper that ends them."""
        return f"{self.namespace}:deadlines"

    def job(self, job_id: str) -> str:
        """Hash: the job record (status, options, stamps, result)."""
        return self.job_prefix + job_id

    @property
    def job_prefix(self) -> str:
        """job without its id: a facade on job records names a job's keys from it itself (its upload: and
        UPLOAD_SUFFIX), so that a job id goes no further than the facade it was handed to."""
        return f"{self.namespace}:job:"

    def upload(self, job_id: str) -> str:
        """String: the raw upload (claim check), deleted once its frame is pushed or the job ends. With bulk
        shards, the bytes lie under this name on the job's shard, and the record carries a marker (SHARDED_UPLOAD
        in its UPLOAD_FIELD) that every step on job records treats as the upload (contract.redis.shards); a record an
        older API stored has the marker under this name here."""
        return self.job(job_id) + UPLOAD_SUFFIX

    def preprocess_queue(self, model_key: str, tenant: str = "") -> str:
        """A model's Celery queue for CPU work (its name, not its Redis key: see celery_queue): one per model,
        and per API key when keys are configured (`tenant`, the key's id; "" without keys). Every CPU worker
        takes from them round robin, so a flood on one model, or from one key, queues behind itself."""
        return f"{PREPROCESS_QUEUE}:{model_key}" + (f"@{tenant}" if tenant else "")

    @staticmethod
    def tenant_of_queue(queue: str) -> str | None:
        """The API key id of a key's own CPU queue (preprocess_queue's name); None for any other queue."""
        if not queue.startswith(PREPROCESS_QUEUE + ":") or "@" not in queue:
            return None
        return queue.partition("@")[2]

    def preprocess_queues(self, model_key: str, tenants: Sequence[str] = ("",)) -> list[str]:
        """Every CPU queue of a model: one per tenant."""
        return [self.preprocess_queue(model_key, tenant) for tenant in tenants]

    def frames(self, model_key: str) -> str:
        """List: a model's packed frames (model_key is name:version) waiting for a GPU worker. LPUSH in,
        pop from the right."""
        return f"{self.namespace}:frames:{model_key}"

    def key_frames(self, model_key: str) -> str:
        """Hash: API key id -> that key's frames of this model pushed and not yet ended by a GPU worker's batch
        write (waiting in the list or in a worker's hands): +1 by the push, -1 by the batch write, a field at 0
        deleted, the hash's TTL renewed by a key's first frame (contract.frames.frame_push). A key below
        `backpressure.head_frames_per_key` has its frame pushed to the head of the list."""
        return f"{self.key_frames_prefix}{model_key}"

    @property
    def key_frames_prefix(self) -> str:
        """key_frames without its model: the claim's Lua names the hash from it and the record's model."""
        return f"{self.namespace}:key_frames:"

    def processing(self, worker_id: str, model_key: str) -> str:
        """List: a model's frames a GPU worker has taken and not yet answered."""
        return f"{self.namespace}:gpu:{worker_id}:processing:{model_key}"

    def heartbeat(self, worker_id: str) -> str:
        """String with a TTL: a GPU worker's self-description while it lives."""
        return f"{self.namespace}:gpu:{worker_id}:heartbeat"

    def gpu_epoch(self, worker_id: str) -> str:
        """String: a GPU worker's current life (a token). Deleted when another worker reaps its frames, so a
        worker that was only paused finds it gone and writes nothing more (gpu_worker.heartbeat)."""
        return f"{self.namespace}:gpu:{worker_id}:epoch"

    def gpu_counters(self, worker_id: str) -> str:
        """Hash: a GPU worker's running totals (device seconds, frames, batches, and each model's frames under
        contract.redis.keys.model_frames_total), updated every batch."""
        return f"{self.namespace}:gpu:{worker_id}:counters"

    @property
    def gpu_workers(self) -> str:
        """Sorted set: GPU worker ids scored by their last heartbeat (epoch seconds)."""
        return f"{self.namespace}:gpu_workers"

    @property
    def callback_outbox(self) -> str:
        """List: ids of ended jobs whose callback still has to be handed to Celery. Also the name of the
        pub/sub channel on which each id is announced as it enters the list (the relays wake on it)."""
        return f"{self.namespace}:callbacks:outbox"

    @property
    def callback_relaying(self) -> str:
        """Sorted set: outbox entries a relay has taken, scored by when (epoch seconds), until Celery has
        their task; an entry older than a minute goes back to the outbox (its relay died holding it)."""
        return f"{self.namespace}:callbacks:relaying"

    @property
    def callback_scheduled(self) -> str:
        """Sorted set: job ids whose callback is retried later, scored by when (epoch seconds); the relays
        move each into the outbox when it is due."""
        return f"{self.namespace}:callbacks:scheduled"

    @property
    def callback_dead(self) -> str:
        """Sorted set: job ids whose callback was given up (the dead letter), scored by when."""
        return f"{self.namespace}:callbacks:dead"

    def callback_slots(self, tenant: str) -> str:
        """Sorted set: the delivery attempts one tenant (an API key, or a receiving host) has in flight, a token
        each scored by when it lapses (its attempt's deadline has passed by then: a worker died holding it)."""
        return f"{self.namespace}:callbacks:slots:{tenant}"

    def callback_held(self, tenant: str) -> str:
        """List: job ids whose callback waits for one of its tenant's slots; a slot given back moves the
        first one to the outbox."""
        return f"{self.namespace}:callbacks:held:{tenant}"

    @property
    def callback_held_tenants(self) -> str:
        """Set: the tenants with callbacks held, which the relays look at each second (a slot whose worker died
        frees nobody's: it lapses, and the relay moves the held ones on)."""
        return f"{self.namespace}:callbacks:held-tenants"

    def auth_failures(self, address: str) -> str:
        """Hash: a client address's token bucket for failed authentications (a 401 takes one); "*": every
        address's together."""
        return f"{self.namespace}:auth_failures:{address}"

    def hit_bucket(self, client_id: str) -> str:
        """String: the bytes an API key's answers (cache hits and computed) may still store and when it was refilled
        (contract.jobs.hits); below zero when computed answers overdrew it."""
        return f"{self.namespace}:hit_bytes:{client_id}"

    def answer_debt(self, client_id: str) -> str:
        """String with a TTL: while it lives, the key's answer bucket is in debt and its submissions are refused
        (contract.jobs.hits). Its name is the bucket's and DEBT_SUFFIX (contract/library/token_bucket.lua)."""
        return self.hit_bucket(client_id) + ANSWER_DEBT_SUFFIX

    def hit_result(self, digest: str) -> str:
        """String with a TTL: a cached answer that cache hits' job records refer to, copied from its entry at the
        first hit and kept as long as the longest-lived of them may live (contract.jobs.hits)."""
        return f"{self.namespace}:hit_result:{digest}"

    def rate_bucket(self, client_id: str) -> str:
        """Hash: an API key's token bucket (tokens, last refill)."""
        return f"{self.namespace}:rate:{client_id}"

    @property
    def cache_prefix(self) -> str:
        """Prefix of the result cache's keys (contract.cache): `e:<digest>` strings (a result document, with
        a TTL), and `lru`, `sizes`, `bytes` and `stats` below."""
        return f"{self.namespace}:cache:"

    def cache_entry(self, digest: str) -> str:
        """String with a TTL: the result document cached for one image, model version, options and scope."""
        return self.cache_prefix + "e:" + digest

    @property
    def cache_lru(self) -> str:
        """Sorted set: cache digests scored by their last use (epoch seconds); the oldest go first."""
        return self.cache_prefix + "lru"

    @property
    def cache_sizes(self) -> str:
        """Hash: cache digest -> the bytes its entry is charged against cache.max_bytes."""
        return self.cache_prefix + "sizes"

    @property
    def cache_bytes(self) -> str:
        """String (integer): the bytes every entry is charged, together; never above cache.max_bytes."""
        return self.cache_prefix + "bytes"

    @property
    def cache_stats(self) -> str:
        """Hash: `<model>:hits` and `<model>:misses` counters, for /v1/stats and the metrics."""
        return self.cache_prefix + "stats"

    @property
    def bulk_life(self) -> str:
        """String, on each bulk shard (contract.redis.shards): a token written when the shard is first seen empty. A
        shard that answers without it lost what it held (it restarted without its data)."""
        return f"{self.namespace}:bulk:life"

    @property
    def bulk_lives(self) -> str:
        """Hash: shard index -> the life token last seen on that shard (contract.redis.shards.ShardWatch)."""
        return f"{self.namespace}:bulk:lives"

    @property
    def bulk_down(self) -> str:
        """Hash: shard index -> when (epoch seconds) a watch first found it unreachable, while it stays so."""
        return f"{self.namespace}:bulk:down"

    @property
    def frames_waiting(self) -> str:
        """Hash: model (name:version) -> its frames on the bulk shards, not yet acknowledged (with shards only):
        counted in by the push, out by the batch write, and set to what the lists hold by each GPU worker's
        heartbeat. The admission's backlog and the CPU workers' full-list check read it (one round trip to the
        control plane, not one per shard)."""
        return f"{self.namespace}:frames_waiting"

    @property
    def durable_fence(self) -> str:
        """Pub/sub channel nobody listens on: a PUBLISH to it is a write on the replication stream that WAIT can
        count, ahead of a read that shows how a job ended (JobIntake.confirm_durable)."""
        return f"{self.namespace}:durable_fence"

    @property
    def job_events(self) -> str:
        """Pub/sub channel: the ids of the jobs one step ended, space-separated (a batch's ends in one message)."""
        return f"{self.namespace}:job_events"


def model_frames_total(model_key: str) -> str:
    """The field of a GPU worker's counters (Keys.gpu_counters) counting one model's frames it answered: what the
    API's drain rate reads (app.drain)."""
    return f"frames_total:{model_key}"
