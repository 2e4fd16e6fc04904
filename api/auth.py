"""Optional API keys (``Authorization: Bearer``), a per-key token bucket kept in Redis, so every API node
shares one budget per key, and short-lived job tokens for the events URL (a browser's EventSource cannot
send an Authorization header)."""

from __future__ import annotations

import hashlib
import hmac
import math

from redis.asyncio import Redis

from api.errors import ApiError
from wire import keys

# KEYS[1] bucket; ARGV: rate (tokens/s), burst, now (s). Returns {allowed (0/1), seconds until a token}.
_TOKEN_BUCKET = """
local rate = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local now = tonumber(ARGV[3])
local state = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens = tonumber(state[1]) or burst
local ts = tonumber(state[2]) or now
tokens = math.min(burst, tokens + math.max(0, now - ts) * rate)
local allowed = 0
local wait = 0
if tokens >= 1 then
  tokens = tokens - 1
  allowed = 1
else
  wait = (1 - tokens) / rate
end
redis.call('HSET', KEYS[1], 'tokens', tokens, 'ts', now)
redis.call('EXPIRE', KEYS[1], math.ceil(burst / rate) + 1)
return {allowed, tostring(wait)}
"""


def key_id(api_key: str) -> str:
    """A key's id in Redis (rate-limit bucket, cache namespace, job owner): a hash, never the key itself;
    "" for no key (auth off)."""
    return hashlib.sha256(api_key.encode()).hexdigest()[:24] if api_key else ""


JOB_TOKEN_TTL_S = 300  # a job token opens its events URL this long; GET /v1/jobs/{id} gives a fresh one


class JobTokens:
    """``<expiry>.<HMAC(job id, expiry)>``: opens one job's events URL (``?token=``) until it expires. The secret is
    derived from the API keys, so every API node with the same keys accepts every node's tokens, no Redis needed;
    the key itself never goes in a URL, and the token cannot be turned back into it."""

    def __init__(self, api_keys: tuple[str, ...], ttl_s: int = JOB_TOKEN_TTL_S) -> None:
        material = b"\0".join(sorted(k.encode() for k in api_keys))
        self._secret = hashlib.sha256(b"pagedserve job token\0" + material).digest()
        self.ttl_s = ttl_s

    def _sign(self, job_id: str, expires_at: int) -> str:
        return hmac.new(self._secret, f"{job_id}\0{expires_at}".encode(), hashlib.sha256).hexdigest()[:32]

    def issue(self, job_id: str, now: float) -> str:
        expires_at = int(now) + self.ttl_s
        return f"{expires_at}.{self._sign(job_id, expires_at)}"

    def check(self, token: str, job_id: str, now: float) -> None:
        """403 for a token that is not this job's (or not a token); 401 once it expired (get a fresh one)."""
        expiry, _, signature = token.partition(".")
        is_expiry = expiry.isascii() and expiry.isdigit() and len(expiry) <= 12
        expires_at = int(expiry) if is_expiry else 0
        if not is_expiry or not hmac.compare_digest(signature.encode(), self._sign(job_id, expires_at).encode()):
            raise ApiError(403, "invalid token for this job", "permission_error", "token", "invalid_job_token")
        if expires_at <= now:
            raise ApiError(
                401,
                "job token expired: GET /v1/jobs/{id} with your API key for a fresh events_url",
                "authentication_error",
                "token",
                "job_token_expired",
            )


class Authenticator:
    """Checks the bearer key (when keys are configured) and charges its rate-limit bucket."""

    def __init__(self, redis: Redis, api_keys: tuple[str, ...], rate_limit_rps: float, burst: int) -> None:
        self._redis = redis
        self._keys = tuple(k.encode() for k in api_keys)
        self.rate_limit_rps = rate_limit_rps
        self.burst = burst
        self._script = redis.register_script(_TOKEN_BUCKET)
        self.job_tokens = JobTokens(api_keys) if api_keys else None  # no keys: the events URL needs none

    @property
    def enabled(self) -> bool:
        return bool(self._keys) or self.rate_limit_rps > 0

    def check_key(self, authorization: str | None) -> str:
        """The caller's key ('' when auth is off); 401 when it is missing or unknown."""
        if not self._keys:
            return ""
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise ApiError(
                401, "missing API key: send Authorization: Bearer <key>", "authentication_error", code="invalid_api_key"
            )
        given = token.strip().encode()
        if not any(hmac.compare_digest(given, k) for k in self._keys):
            raise ApiError(401, "invalid API key", "authentication_error", code="invalid_api_key")
        return token.strip()

    async def charge(self, api_key: str, now: float) -> None:
        """One request from this key's bucket; 429 with Retry-After when it is empty."""
        if self.rate_limit_rps <= 0:
            return
        allowed, wait = await self._script(
            keys=[keys.rate_limit_key(key_id(api_key))], args=[self.rate_limit_rps, self.burst, now]
        )
        if int(allowed):
            return
        retry_after = max(1, math.ceil(float(wait)))
        raise ApiError(
            429,
            f"rate limit exceeded for this API key; retry after {retry_after} s",
            "rate_limit_error",
            code="rate_limit_exceeded",
            headers={"Retry-After": str(retry_after)},
        )

    def events_link(self, job_id: str, now: float) -> dict[str, str]:
        """A job's ``events_url`` (and its ``token`` when keys are on: an EventSource sends no Authorization)."""
        url = f"/v1/jobs/{job_id}/events"
        if self.job_tokens is None:
            return {"events_url": url}
        token = self.job_tokens.issue(job_id, now)
        return {"events_url": f"{url}?token={token}", "token": token}

    def check_job_token(self, token: str, job_id: str, now: float) -> bool:
        """True once ``token`` opens this job (401/403 when not); False when keys are off (no token needed)."""
        if self.job_tokens is None:
            return False
        self.job_tokens.check(token, job_id, now)
        return True

    async def authorize(self, authorization: str | None, now: float) -> str:
        """The caller's key id (``key_id``; "" when keys are off) once its key is checked and charged."""
        if not self.enabled:
            return ""
        key = self.check_key(authorization)
        await self.charge(key, now)
        return key_id(key)
