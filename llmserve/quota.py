"""`llmserve quota KEY --rpm N --tpm N --priority-floor P`: one API key's own requests and tokens per minute, and the
lowest priority its requests run at (a request asking for a lower one runs at P), kept in Redis where every gateway
reads them at admission (KEY_RPM and KEY_TPM are every other key's; other keys have no floor); `--clear` gives the
key the defaults again; without limits, it prints the key's quota and what it has used this minute."""

from __future__ import annotations

from common.clients import sync_client
from common.keys import Keys
from common.settings import Settings
from gateway.middleware import tenant_of


def quota(key: str, rpm: int | None, tpm: int | None, clear: bool, settings: Settings | None = None,
          priority_floor: int | None = None) -> str:
    settings = settings or Settings.from_env()
    if key not in [k.strip() for k in settings.api_keys.split(",")]:
        raise SystemExit("llmserve quota: that key is not one of API_KEYS")
    keys, tenant = Keys(settings.namespace), tenant_of(key.encode())
    redis = sync_client(settings.redis_url)
    if clear:
        redis.hdel(keys.quotas, tenant)
        redis.hdel(keys.priority_floors, tenant)
    if priority_floor is not None:
        redis.hset(keys.priority_floors, tenant, priority_floor)
    if not clear and (rpm is not None or tpm is not None):
        held = (redis.hget(keys.quotas, tenant) or b"").decode().split()
        own = [int(v) for v in held] if len(held) == 2 else [settings.key_rpm, settings.key_tpm]
        redis.hset(keys.quotas, tenant, f"{own[0] if rpm is None else rpm} {own[1] if tpm is None else tpm}")
    held = (redis.hget(keys.quotas, tenant) or b"").decode().split()
    rpm_now, tpm_now = (int(v) for v in held) if len(held) == 2 else (settings.key_rpm, settings.key_tpm)
    window = redis.hgetall(keys.quota(tenant))
    used = {k.decode(): int(v) for k, v in window.items()}
    source = "its own" if len(held) == 2 else "the defaults (KEY_RPM, KEY_TPM)"
    floor = redis.hget(keys.priority_floors, tenant)
    return (f"key {tenant}: {rpm_now or 'unlimited'} requests and {tpm_now or 'unlimited'} tokens per minute "
            f"({source}); priority at best {floor.decode() if floor is not None else 'as asked'}; this window: "
            f"{used.get('r', 0)} requests, {used.get('t', 0)} tokens")
