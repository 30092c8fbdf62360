"""Every setting of the service: its sections as frozen, validated dataclasses (`sections`), and the checks that tie
them together. The models' own settings and their routing are `models`'; `config` reads them from YAML and the
environment (`load_settings`); configs/default.yaml names every one with its default. `cell_layout` is the API
tier's alone, kept here beside `cells`: each cell's settings are made from these sections, and nothing here reads Redis.
"""

from __future__ import annotations

from dataclasses import field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from contract.settings.cells import CellSettings, check_cells
from contract.settings.models import ModelSpec, RoutingSettings, default_model
from contract.settings.redis_settings import BulkSettings, RedisSettings
from contract.settings.scaling import ScalingSettings
from contract.settings.sections import SettingsError, settings_class

REPO_ROOT = Path(__file__).resolve().parents[2]

# The story's batch-size table (ms per batch on its GPU): the `sim` device's default profile.
STORY_PROFILE_MS = {1: 72.0, 4: 150.0, 8: 260.0, 16: 430.0}


@settings_class
class DecodeSettings:
    """What a CPU worker will decode: checked from the image's header before a pixel is decoded."""

    max_image_pixels: int = 80_000_000
    # What a decode holds at its peak, judged by format and mode before decoding (tasks.decoding.peak_memory): a WebP's
    # decoder holds 12 bytes a canvas pixel, a progressive JPEG every coefficient at full size.
    max_decoded_bytes: int = 256 * 1024 * 1024
    # A progressive JPEG is decoded once per scan: a few KB repeating one scan thousands of times held a CPU
    # worker for its whole time limit. Counted from the file's markers before decoding (tasks.decoding.imaging).
    max_scans: int = 100
    max_pixel_scans: int = 2_000_000_000  # pixels x scans: the decoding work one image may ask for
    # Pillow reads a file's framing and metadata in Python, a step per block: a file of nothing but empty
    # blocks held a CPU worker for seconds. The structure is walked first (tasks.decoding.structure), counting the steps
    # Pillow would take: JPEG segments before the first scan, PNG and WebP chunks, GIF blocks before the first
    # frame. GIF comment blocks are joined one onto another (their cost grows with their square): fewer.
    max_blocks: int = 20_000
    max_comment_blocks: int = 1_000
    # Pillow copies each EXIF value from wherever its entry points, overlapping or not: a small file can ask for
    # hundreds of MB (benchmarks/2026-12-05-hostile-decode.md). EXIF bytes joined and read, at most this; entries too.
    max_exif_bytes: int = 256 * 1024
    max_exif_tags: int = 1_000
    # A BMP's RLE commands, each a Python step of the decoder (tasks.decoding.bmp_rle; each pixel it writes costs C
    # only).
    max_rle_commands: int = 1_000_000


@settings_class
class ApiSettings:
    max_upload_bytes: int = 20 * 1024 * 1024
    max_wait_s: float = 30.0
    body_timeout_s: float = 10.0  # a body must come within this plus its size at body_min_rate; else 408
    body_min_rate: float = 65536.0  # bytes/s
    # 0: /metrics is served on the API's own port. Otherwise only on this port (bound to
    # metrics_host), so an internal network can scrape what the public port does not show.
    metrics_port: int = 0
    metrics_host: str = "0.0.0.0"
    # The HTTP server (configs/gunicorn.conf.py reads these). This machine only unless told: auth is off by
    # default, and a laptop's make run must not serve its network; the containers bind 0.0.0.0 on theirs.
    bind: str = "127.0.0.1:8000"
    workers: int = 2
    worker_class: str = "app.server.ProblemGeventWorker"  # gevent; "gthread" for threads
    connections: int = 2000  # per worker, gevent
    threads: int = 64  # per worker, gthread
    access_log: str = ""  # a path, or "-" for stderr; empty: none (the API's own JSON lines say enough)
    flower_url: str = ""  # where Flower answers, for `GET /` to link to (make run and compose set it); "": no link
    # What one client (API key) may hold in one API process at once (app.holds): past each, 429. Long-polls held
    # by everyone at most max_waits (0, and at most: half the process's connections or threads), past it 503.
    max_requests_per_client: int = 256
    max_waits_per_client: int = 100
    max_waits: int = 0
    # Bodies in flight, from their first byte until their request ends (a multipart image's copy too): every
    # client's in one process (past it 503), one client's (429). Each must hold a multipart upload at the limit.
    max_body_bytes: int = 128 * 1024 * 1024
    max_body_bytes_per_client: int = 48 * 1024 * 1024

    def __post_init__(self) -> None:
        if min(self.max_body_bytes, self.max_body_bytes_per_client) < 2 * self.max_upload_bytes:
            raise SettingsError(
                "api.max_body_bytes and max_body_bytes_per_client must each hold a multipart upload at the limit "
                f"(its body and its image: 2 x api.max_upload_bytes = {2 * self.max_upload_bytes})"
            )
        if min(self.max_requests_per_client, self.max_waits_per_client) < 1 or self.max_waits < 0:
            raise SettingsError("api.max_requests_per_client and max_waits_per_client must be >= 1, max_waits >= 0")


@settings_class
class LogSettings:
    format: str = "json"  # json: one object per line (contract.runtime.logs); text: plain lines
    level: str = "INFO"
    verbose: bool = False  # true: Celery's, gunicorn's and Flower's start-up chatter too (make run VERBOSE=1)

    def __post_init__(self) -> None:
        if self.format not in ("json", "text"):
            raise SettingsError(f"logs.format must be json or text, not {self.format!r}")
        if self.level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
            raise SettingsError(f"logs.level must be a logging level name, not {self.level!r}")


@settings_class
class JobSettings:
    ttl_s: int = 3600
    max_ttl_s: int = 14400  # the longest a record lives from its submission: callback retries stop at it
    upload_ttl_s: int = 600
    default_deadline_ms: int = 60_000
    # Signs every job id (contract.jobs.ids); one value for every API process. Empty: var/job-id-secret, made once.
    id_secret: str = ""
    accept_unchecked_ids: bool = True  # ids from before the check (their first digit 0): read, never called lost
    # What one API key's answers may hold in the store, computed or cache hits: a bucket of this many bytes refilled
    # at this many per ttl_s (contract.jobs.hits); 0: off. Was `cache.hit_bytes_per_key`, still read for one release.
    # 256 MiB: a key holds at most ~twice it, under 90% of make run's and compose's 1 GB (store-full) alone.
    answer_bytes_per_key: int = 256 * 1024 * 1024

    def __post_init__(self) -> None:
        if self.answer_bytes_per_key < 0:
            raise SettingsError("jobs.answer_bytes_per_key must be >= 0")


@settings_class
class CacheSettings:
    """The result cache (contract.cache): a repeated image, under the same model version and options, is
    answered from the first one's result without a CPU worker or a GPU slot."""

    enabled: bool = True  # a model spec's `cache: false` turns it off for that model
    max_bytes: int = 64 * 1024 * 1024  # the entries' result documents (plus ENTRY_OVERHEAD each), never more
    ttl_s: int = 3600  # an entry not used for this long is gone (each hit renews it)
    # false: an entry serves only the API key that made it. true: every key of the deployment; a hit then
    # tells one tenant that another sent the same image (docs/operations.md).
    shared: bool = False
    # "": the entries on the control plane (each cell's). Set: on that Redis, one for the API tier; slower than
    # timeout_ms or down, a miss and a dropped write, not tried for retry_s (contract.cache.cache_plane)
    redis_url: str = ""
    timeout_ms: int = 100
    retry_s: float = 1.0

    def __post_init__(self) -> None:
        if self.max_bytes < 0 or self.ttl_s < 1:
            raise SettingsError("cache.max_bytes must be >= 0, cache.ttl_s >= 1")
        bad_url = self.redis_url and not self.redis_url.startswith(("redis", "unix://"))
        if bad_url or min(self.timeout_ms, self.retry_s) <= 0:
            raise SettingsError("cache.redis_url must be a redis:// URL or empty, timeout_ms >= 1, retry_s > 0")


@settings_class
class BatchingSettings:
    max_batch_size: int = 8
    window_ms: float = 12.0
    idle_poll_s: float = 1.0
    gather_poll_ms: float = 2.0
    held_poll_ms: float = 5.0  # a batch held open behind its model's running batch looks this often


@settings_class
class GpuWorkerSettings:
    device: str = "auto"
    # The models this worker serves: "name" (each of its versions) or "name:version"; empty: every model
    # configured. `--model` on the command line takes precedence.
    models: tuple[str, ...] = ()
    heartbeat_ttl_s: float = 10.0
    max_candidates: int = 1000
    torch_threads: int = 0
    busy_window_s: float = 60.0
    max_attempts: int = 3  # a frame requeued this often (its worker died each time) fails as poison
    metrics_port: int = 0  # Prometheus metrics here (0: none); --metrics-port overrides
    metrics_host: str = "127.0.0.1"
    # device `sim`: ms per batch by batch size (the story's table by default)
    sim_latency_ms: dict[int, float] = field(default_factory=lambda: dict(STORY_PROFILE_MS))


@settings_class
class BackpressureSettings:
    max_frames: int = 64  # the frame list never holds more; CPU workers wait for room
    max_backlog: int = 256  # preprocess queue + frame list above this: the API answers 429
    retry_after_s: int = 1  # the least Retry-After a refusal gives (it is computed from the drain rate)
    room_poll_s: float = 0.005
    head_frames_per_key: int = 8  # a key with fewer frames waiting or in flight goes to the list's head; 0: off
    # Bytes of uploads and frames waiting in Redis (contract.admission.budget): a model's (a spec may set its own), and
    # every model's together. Over a model's: 429; over the total, or Redis past store_full_ratio of its
    # maxmemory: 503. Size Redis's maxmemory above the total plus the job records (see the docs).
    max_waiting_bytes: int = 192 * 1024 * 1024
    max_total_waiting_bytes: int = 256 * 1024 * 1024
    store_full_ratio: float = 0.9


@settings_class
class CallbackSettings:
    secret: str = ""  # HMAC key; IMGSERVE_CALLBACK_SECRET overrides; empty: callbacks refused
    allow_hosts: tuple[str, ...] = ()  # hosts or CIDRs allowed even when private/loopback (an internal receiver)
    max_attempts: int = 24  # deliveries tried before the callback is given up (its dead letter)...
    retry_for_s: float = 86400.0  # ...or once it has been retried this long since its first attempt
    backoff_base_s: float = 1.0  # attempt n+1 waits base * 2**(n-1), at most backoff_max_s, jittered
    backoff_max_s: float = 3600.0
    jitter: float = 0.2  # each wait drawn within +-20% of that, so receivers coming back are not stampeded
    timeout_s: float = 5.0  # the longest one wait (connect, a read, a write) of an attempt
    # An attempt whole: the host's lookup, connecting, TLS, sending, the answer's headers and body. A receiver that
    # trickles its answer or never sends one holds a callback thread this long, no longer (tasks.callbacks.http_client).
    deadline_s: float = 10.0
    # Attempts one tenant (its API key; without keys, the receiving host) may have in flight across every callback
    # worker; its others wait in Redis, holding no thread, until one ends. Its slow receivers hold this many of
    # the threads, never another tenant's.
    max_per_tenant: int = 4
    max_response_bytes: int = 65536
    # At submit, the callback host's lookup runs in a thread of the API process's own, never on its event loop
    # (app.callback_lookups): the submission waits for it this long, then is a 400 (did not resolve in time).
    lookup_timeout_s: float = 2.0
    # Lookups one key (without keys: one client address) may have unfinished in an API process, a thread held
    # in a name server that never answers included: past them that key gets a 429, no one else...
    max_lookups_per_key: int = 4
    lookup_threads: int = 64  # ...and the process this many in all (a 503 past them)

    def __post_init__(self) -> None:
        if self.deadline_s <= 0 or self.timeout_s <= 0 or self.max_per_tenant < 1:
            raise SettingsError("callbacks.deadline_s and timeout_s must be > 0, callbacks.max_per_tenant >= 1")
        if self.lookup_timeout_s <= 0 or self.max_lookups_per_key < 1 or self.lookup_threads < 1:
            raise SettingsError(
                "callbacks.lookup_timeout_s must be > 0, callbacks.max_lookups_per_key and lookup_threads >= 1"
            )


API_KEY_FIELDS = {"id", "sha256", "callback_secret_env", "callback_secret_file", "admin"}


@settings_class
class AuthSettings:
    # [{id: team-a, sha256: <hex of the key>, callback_secret_env: TEAM_A_CALLBACK_SECRET}]; empty: /v1 is open.
    # A key's callback secret is named, never written here: an environment variable or a file (a compose secret).
    # `admin: true` lets a key read /v1/stats (every tenant's traffic).
    api_keys: tuple[Any, ...] = ()
    rate_per_s: float = 0.0  # per key; 0: no limit
    burst: float = 20.0
    # A key's own jobs waiting for a CPU worker may fill at most this share of a model's backlog: past it, 429
    # for that key alone (its flood does not get the others refused). Each key also has its own CPU queue.
    max_backlog_share: float = 0.5
    max_waiting_bytes_share: float = 0.5  # ...and its uploads' bytes of each byte budget (contract.admission.budget)
    # A key's expensive decodes in flight (uploads estimated at 32 MiB of decoding or more, admission.decode_share)
    # may add up to this many bytes; one more is 429 unless the key has none in flight. 0: off.
    max_decode_bytes_in_flight: int = 256 * 1024 * 1024
    failed_per_s: float = 1.0  # failed authentications per client address (IPv6: per /64); past them 429; 0: off
    failed_burst: float = 20.0
    failed_total_per_s: float = 20.0  # ...and from every address together (guesses spread over many); 0: off
    failed_total_burst: float = 200.0

    def __post_init__(self) -> None:
        if not 0 < self.max_waiting_bytes_share <= 1:
            raise SettingsError("auth.max_waiting_bytes_share must be > 0 and <= 1")
        for entry in self.api_keys:
            if not isinstance(entry, dict) or not {"id", "sha256"} <= set(entry):
                raise SettingsError("each auth.api_keys entry needs an id and a sha256")
            unknown = set(entry) - API_KEY_FIELDS
            if unknown:
                raise SettingsError(
                    f"unknown auth.api_keys fields: {', '.join(sorted(unknown))} "
                    f"(a callback secret is named by callback_secret_env or callback_secret_file)"
                )


@settings_class
class CeleryWorkerSettings:
    visibility_timeout_s: int = 300
    task_time_limit_s: int = 60
    events_flush_ms: int = 250  # task events leave in one message this long after the first (tasks.hop.event_batching)
    # A Celery worker silent this long is dead: its held tasks go back (tasks.hop.recovery).
    heartbeat_ttl_s: float = 10.0
    sweep_s: float = 0.5  # how often each worker ends the jobs whose deadline passed (tasks.hop.job_sweeps)
    # A job still queued this long whose task is in no queue and in no worker's hands, twice in a row, is sent its
    # task again (tasks.hop.lost_deliveries: a worker killed as it took the message from Redis).
    lost_delivery_s: float = 5.0

    def __post_init__(self) -> None:
        if self.heartbeat_ttl_s < 3 or self.sweep_s <= 0 or self.lost_delivery_s <= 0:
            raise SettingsError(
                "celery.heartbeat_ttl_s must be at least 3 (a worker beats every third of it), "
                "celery.sweep_s and celery.lost_delivery_s above 0"
            )


@settings_class
class Settings:
    # The default model (routing.default, or the first listed); `models` holds every model served. A config
    # that names one `model:` (as before) serves that one.
    model: ModelSpec
    models: tuple[ModelSpec, ...] = ()
    routing: RoutingSettings = field(default_factory=RoutingSettings)
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis: RedisSettings = field(default_factory=RedisSettings)
    namespace: str = "imgserve"
    api: ApiSettings = field(default_factory=ApiSettings)
    logs: LogSettings = field(default_factory=LogSettings)
    decode: DecodeSettings = field(default_factory=DecodeSettings)
    jobs: JobSettings = field(default_factory=JobSettings)
    batching: BatchingSettings = field(default_factory=BatchingSettings)
    gpu_worker: GpuWorkerSettings = field(default_factory=GpuWorkerSettings)
    celery: CeleryWorkerSettings = field(default_factory=CeleryWorkerSettings)
    backpressure: BackpressureSettings = field(default_factory=BackpressureSettings)
    auth: AuthSettings = field(default_factory=AuthSettings)
    callbacks: CallbackSettings = field(default_factory=CallbackSettings)
    cache: CacheSettings = field(default_factory=CacheSettings)
    bulk: BulkSettings = field(default_factory=BulkSettings)
    scaling: ScalingSettings = field(default_factory=ScalingSettings)
    cells: tuple[CellSettings, ...] = ()  # the API tier's control planes (settings.cells); none: redis_url's alone

    @property
    def broker_url(self) -> str:
        """Celery's: redis_url, or with Sentinels one `sentinel://` URL each (kombu's form), carrying redis_url's
        password and database for the primary they name (tasks.hop.celery_app passes the service's name)."""
        if not self.redis.sentinels:
            return self.redis_url
        parts = urlsplit(self.redis_url)
        userinfo = parts.netloc.rpartition("@")[0]
        database = parts.path.lstrip("/") or "0"
        return ";".join(
            f"sentinel://{userinfo + '@' if userinfo else ''}{address}/{database}" for address in self.redis.sentinels
        )

    @property
    def tenants(self) -> tuple[str, ...]:
        """Whose jobs have CPU queues of their own: "" (no key, or jobs from before keys) and every API key."""
        return ("", *(str(entry["id"]) for entry in self.auth.api_keys))

    def __post_init__(self) -> None:
        if not self.models:  # built in code with one model (tests, tools)
            object.__setattr__(self, "models", (self.model,))
        object.__setattr__(self, "model", default_model(self, self.gpu_worker.models))
        check_cells(self.cells)
        largest = self.api.max_upload_bytes
        for spec in self.models:
            if min(self.max_waiting_bytes(spec), self.backpressure.max_total_waiting_bytes) < largest:
                raise SettingsError(
                    f"model {spec.key}: its byte budgets (backpressure.max_waiting_bytes, "
                    "max_total_waiting_bytes) must hold one upload of api.max_upload_bytes "
                    f"({largest})"
                )
            if self.jobs.upload_ttl_s < self.default_deadline_ms(spec) / 1000.0 + 60:
                raise SettingsError(
                    f"jobs.upload_ttl_s must outlast model {spec.key}'s deadline by a minute: an "
                    "upload is deleted when its job ends, and its TTL is only the last resort"
                )

    def max_frames(self, spec: ModelSpec) -> int:
        return spec.max_frames or self.backpressure.max_frames

    def max_backlog(self, spec: ModelSpec) -> int:
        return spec.max_backlog or self.backpressure.max_backlog

    def default_deadline_ms(self, spec: ModelSpec) -> int:
        return spec.default_deadline_ms or self.jobs.default_deadline_ms

    def max_waiting_bytes(self, spec: ModelSpec) -> int:
        return spec.max_waiting_bytes or self.backpressure.max_waiting_bytes

    def caches(self, spec: ModelSpec) -> bool:
        """Whether `spec`'s results are cached: its own `cache`, else the deployment's."""
        enabled = self.cache.enabled if spec.cache is None else spec.cache
        return enabled and self.cache.max_bytes > 0
