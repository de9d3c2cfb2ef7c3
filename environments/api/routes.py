"""The rollout API's HTTP layer: request bodies, errors as JSON, the routes and their
handlers over :class:`~environments.api.server.RolloutAPI` (its state and queue), and
``serve``. Atropos's routes (``/register``, ``/scored_data``, ``/batch``, ...) and ours
(``/lease``, ``/ack``, ``/dead_letters``, ...); docs/rollout-api.md."""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import asdict
from typing import Any, Callable, TypeVar

import orjson
from aiohttp import web
from pydantic import BaseModel, ValidationError

from environments.api.schemas import (
    Ack,
    APIConfig,
    Checkpointed,
    EnvIdentifier,
    LeaseId,
    LeaseRequest,
    PolicyVersion,
    RegisterEnv,
    Registration,
    Resume,
    StatusWait,
)
from environments.api.server import APIError, EnvRecord, RolloutAPI, json_response
from environments.api.wire import WireError, decode_group, decode_group_list
from environments.settings import token_matches
from environments.trajectory import field_path

log = logging.getLogger("lachesis.api")

API_KEY = web.AppKey("api", RolloutAPI)
M = TypeVar("M", bound=BaseModel)


async def read_body(request: web.Request) -> bytes:
    """The request body, gunzipped when sent with ``Content-Encoding: gzip``."""
    api = request.app[API_KEY]
    limit = int(api.config.max_body_mb * 1024 * 1024)
    if request.content_length is not None and request.content_length > limit:
        api.count_rejection("too_large")
        raise APIError(413, f"request body of {request.content_length} bytes exceeds "
                            f"the {limit}-byte limit (max_body_mb)", field="body", close=True)
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        api.count_rejection("too_large")
        raise APIError(413, f"request body exceeds the {limit}-byte limit (max_body_mb, "
                            "after decompression)", field="body", close=True) from None
    except Exception as error:  # broken gzip stream and the like
        api.count_rejection("malformed")
        raise APIError(400, f"unreadable request body ({type(error).__name__}: {error})",
                       field="body", close=True) from None


async def parse(request: web.Request, model: type[M], allow_empty: bool = False) -> M:
    body = await read_body(request)
    if not body.strip() and allow_empty:
        body = b"{}"
    try:
        return model.model_validate_json(body)
    except ValidationError as error:
        api = request.app[API_KEY]
        first = error.errors()[0]
        if first["type"] == "json_invalid":
            api.count_rejection("malformed")
            raise APIError(400, f"malformed JSON: {first['msg']}", field="body") from None
        raise unprocessable(api, error) from None


def unprocessable(api: RolloutAPI, error: ValidationError) -> APIError:
    """A request that does not fit its schema: counted, and a 422 naming each field."""
    api.count_rejection("invalid")
    errors = [{"field": field_path(e["loc"]) or "body", "message": e["msg"]}
              for e in error.errors()]
    return APIError(422, f"{errors[0]['field']}: {errors[0]['message']}",
                    field=errors[0]["field"], errors=errors)


OPEN_PATHS = frozenset({"/health"})
"""The routes answered without the token (with one set): the health check only."""


@web.middleware
async def errors_as_json(request: web.Request, handler):
    api = request.app[API_KEY]
    try:
        if api.config.token is not None and request.path not in OPEN_PATHS \
                and not token_matches(request.headers.get("Authorization"), api.config.token):
            api.count_rejection("unauthorized")
            raise APIError(401, "missing or wrong bearer token (Authorization header)")
        response = await handler(request)
        if request.method != "GET" or request.path == "/batch":  # it may have changed state
            api.changed()
        return response
    except APIError as error:
        body = {"error": error.message, **({"field": error.field} if error.field else {}),
                **error.extra}
        response = json_response(body, error.status)
        if error.close:
            response.force_close()
        return response
    except web.HTTPException as error:  # 404, 405 from routing
        return json_response({"error": error.reason}, error.status)
    except Exception as error:
        log.exception("%s %s failed", request.method, request.path)
        return json_response({"error": f"internal error: {type(error).__name__}: {error}"}, 500)


def decoded(api: RolloutAPI, decode: Callable[[bytes], Any], body: bytes) -> Any:
    """``decode(body)``; a body it refuses is counted and answered with its status."""
    try:
        return decode(body)
    except WireError as error:
        api.count_rejection("malformed" if error.status == 400 else "invalid")
        raise APIError(error.status, str(error), field=error.field) from None


async def handle_scored_data(request: web.Request) -> web.Response:
    api = request.app[API_KEY]
    group = decoded(api, decode_group, await read_body(request))
    result = (await api.store_groups([group]))[0]
    if group.env_id is not None:  # the pushing env's queue, this group included
        result.update(api.own_queue(group.env_id))
    return json_response({"status": "received", **result})


async def handle_scored_data_list(request: web.Request) -> web.Response:
    api = request.app[API_KEY]
    groups = decoded(api, decode_group_list, await read_body(request))
    results = await api.store_groups(groups)
    return json_response({"status": "received", "groups_processed": len(groups),
                          "groups": results})


def batch_body(bodies: list[bytes] | None, **fields: Any) -> web.Response:
    """``{...fields, "batch": [stored bodies]}`` assembled without re-encoding them."""
    head = orjson.dumps(fields)[:-1] + (b"," if fields else b"")
    batch = b"null" if bodies is None else b"[" + b",".join(bodies) + b"]"
    return web.Response(body=head + b'"batch":' + batch + b"}",
                        content_type="application/json")


async def handle_batch(request: web.Request) -> web.Response:
    api = request.app[API_KEY]
    if api.trainer is None:
        return json_response({"status": "error", "batch": [],
                              "message": "Trainer not registered. Call /register first."}, 409)
    bodies = await api.take_batch(api.trainer.batch_size)
    if bodies is None:
        return batch_body(None, reason=api.why_no_batch(api.trainer.batch_size))
    return batch_body(bodies)


LEASE_RECHECK_S = 0.25
"""A waiting ``/lease`` (``wait_s``) looks at the queue at least this often: batching has
rules that wait on the clock too (``mix_wait_s``)."""


async def handle_lease(request: web.Request) -> web.Response:
    api = request.app[API_KEY]
    req = await parse(request, LeaseRequest, allow_empty=True)
    batch_size = req.batch_size or (api.trainer.batch_size if api.trainer else None)
    if batch_size is None:
        raise APIError(409, "no batch_size: give one or register the trainer first",
                       field="batch_size")
    leased = await api.lease_batch(batch_size, req.trainer_id)
    deadline = time.monotonic() + req.wait_s
    while leased is None and (left := deadline - time.monotonic()) > 0:
        # woken by a push; a batch held for an env (mix_wait_s) is looked at again soon
        await api.wait_for_change(min(left, LEASE_RECHECK_S))
        leased = await api.lease_batch(batch_size, req.trainer_id)
    if leased is None:
        return batch_body(None, lease_id=None, step=api.step,
                          reason=api.why_no_batch(batch_size), silent=api.silent_envs())
    lease, bodies = leased
    return batch_body(bodies, lease_id=lease.lease_id, step=api.step,
                      expires_at=lease.expires_at, policy_version=api.policy_version)


async def handle_ack(request: web.Request) -> web.Response:
    api = request.app[API_KEY]
    req = await parse(request, Ack)
    await api.ack(req.lease_id, {d.group_id: d.reason for d in req.dead_letters}, req.step,
                  {d.group_id: d.reason for d in req.dropped})
    return json_response({"status": "acked", "current_step": api.step,
                          "dead_lettered": len(req.dead_letters)})


async def handle_dead_letters(request: web.Request) -> web.Response:
    """``GET /dead_letters?limit=N``: the newest groups set aside, with reasons and bodies."""
    api = request.app[API_KEY]
    try:
        limit = int(request.query.get("limit", "100"))
        if not 0 <= limit <= 100_000:
            raise ValueError
    except ValueError:
        raise APIError(422, "limit must be an integer from 0 to 100000", field="limit") from None
    total, rows = await api._in_db_thread(api.db.dead_letters, limit)
    items = [orjson.dumps({"group_id": d.group_id, "env_id": d.env_id, "reason": d.reason,
                           "trainer": d.trainer, "at": d.at})[:-1] + b',"group":' + d.body + b"}"
             for d in rows]
    return web.Response(body=b'{"total":' + str(total).encode() + b',"dead_letters":['
                        + b",".join(items) + b"]}", content_type="application/json")


async def handle_nack(request: web.Request) -> web.Response:
    api = request.app[API_KEY]
    req = await parse(request, LeaseId)
    lease = api.leases.get(req.lease_id)
    if lease is None:
        raise APIError(409, f"lease {req.lease_id!r} is not active", field="lease_id")
    await api.return_lease(lease, {"nacked_leases": 1, "redelivered_groups": len(lease.groups)})
    return json_response({"status": "returned", "groups": len(lease.groups)})


async def handle_register(request: web.Request) -> web.Response:
    api = request.app[API_KEY]
    reg = await parse(request, Registration)
    kv: dict[str, Any] = {"trainer": reg.model_dump()}
    if api.trainer is None and api.step == 0:
        kv["step"] = reg.starting_step
    await api._write(api.db.put, kv=kv, counts={"trainer_registrations": 1})
    api.trainer = reg
    api.step = kv.get("step", api.step)
    # Atropos answers a 128-bit integer, more than orjson encodes.
    return web.Response(text=json.dumps({"uuid": uuid.uuid4().int}),
                        content_type="application/json")


async def handle_register_env(request: web.Request) -> web.Response:
    api = request.app[API_KEY]
    req = await parse(request, RegisterEnv)
    env_id = max(api.envs, default=-1) + 1
    same_name = sum(e.desired_name == req.desired_name for e in api.envs.values())
    env = EnvRecord(env_id=env_id, desired_name=req.desired_name,
                    real_name=f"{req.desired_name}_{same_name}", weight=req.weight,
                    group_size=req.group_size, max_token_length=req.max_token_length,
                    min_batch_allocation=req.min_batch_allocation)
    api.envs[env_id] = env  # taken before the write: envs registering at once get distinct ids
    try:
        await api._write(api.db.put_env, env_id, asdict(env), counts={"env_registrations": 1})
    except BaseException:
        del api.envs[env_id]
        raise
    trainer = api.trainer
    return json_response({
        "status": "success", "env_id": env_id, "wandb_name": env.real_name,
        "checkpoint_dir": trainer.checkpoint_dir if trainer else "",
        "starting_step": api.step,
        "checkpoint_interval": trainer.save_checkpoint_interval if trainer else 0,
        "num_steps": trainer.num_steps if trainer else -1,
    })


async def handle_disconnect_env(request: web.Request) -> web.Response:
    api = request.app[API_KEY]
    req = await parse(request, EnvIdentifier)
    env = api.envs.get(req.env_id)
    if env is None:
        raise APIError(404, f"unknown env_id {req.env_id}", field="env_id")
    env.connected = False
    await api._write(api.db.put_env, env.env_id, asdict(env))
    return json_response({"status": "success"})


async def handle_status_env(request: web.Request) -> web.Response:
    api = request.app[API_KEY]
    if "env_id" in request.query:  # also accept ?env_id=N (Atropos sends a JSON body)
        try:
            env_id = int(request.query["env_id"])
        except ValueError:
            raise APIError(422, "env_id must be an integer", field="env_id") from None
    else:
        env_id = (await parse(request, EnvIdentifier)).env_id
    try:
        wait = StatusWait.from_query(request.query)
    except ValidationError as error:
        raise unprocessable(api, error) from None
    except ValueError as error:  # wait_s with nothing to wait for
        api.count_rejection("invalid")
        raise APIError(422, str(error), field="wait_s") from None
    status = api.env_status(env_id)
    deadline = time.monotonic() + wait.wait_s
    while not wait.answered_by(status) and (left := deadline - time.monotonic()) > 0:
        await api.wait_for_change(left)
        status = api.env_status(env_id)
    return json_response(status)


async def handle_policy_version(request: web.Request) -> web.Response:
    api = request.app[API_KEY]
    req = await parse(request, PolicyVersion)
    if api.policy_version is not None and req.version < api.policy_version:
        raise APIError(409, f"policy version {req.version} is older than the current "
                            f"{api.policy_version}", field="version")
    await api._write(api.db.put, kv={"policy_version": req.version,
                                     "policy_model": req.model})
    api.policy_version, api.policy_model = req.version, req.model
    return json_response({"policy_version": api.policy_version,
                          "policy_model": api.policy_model})


async def handle_resume(request: web.Request) -> web.Response:
    """``POST /resume``: the trainer restarted from its checkpoint of step ``version``
    (:meth:`RolloutAPI.resume`). The explicit way back: ``/policy_version`` still
    refuses a version older than the current one."""
    api = request.app[API_KEY]
    req = await parse(request, Resume)
    return json_response(await api.resume(req.version, req.model, req.trainer_id))


async def handle_checkpoint(request: web.Request) -> web.Response:
    """``POST /checkpoint``: the trainer can no longer resume from before ``oldest_step``;
    the bodies of groups trained up to it are released."""
    api = request.app[API_KEY]
    req = await parse(request, Checkpointed)
    released = await api._write(api.db.release_trained, req.oldest_step,
                                kv={"oldest_checkpoint": req.oldest_step})
    return json_response({"released_bodies": released})


async def handle_accounting(request: web.Request) -> web.Response:
    api = request.app[API_KEY]
    return json_response(await api._in_db_thread(api.db.accounting))


async def handle_reset(request: web.Request) -> web.Response:
    await request.app[API_KEY].reset()
    return json_response({"status": "reset"})


def build_app(config: APIConfig) -> web.Application:
    api = RolloutAPI(config)
    app = web.Application(client_max_size=int(config.max_body_mb * 1024 * 1024),
                          middlewares=[errors_as_json])
    app[API_KEY] = api
    app.on_startup.append(api.start)
    app.on_cleanup.append(api.stop)

    def get(fn: Callable[[RolloutAPI], Any]):
        async def handler(request: web.Request) -> web.Response:
            return json_response(fn(request.app[API_KEY]))
        return handler

    def info(api: RolloutAPI) -> dict[str, Any]:
        t = api.trainer
        return {"batch_size": t.batch_size if t else -1, "max_token_len": t.max_token_len if t else -1}

    def wandb_info(api: RolloutAPI) -> dict[str, Any]:
        t = api.trainer
        return {"group": t.wandb_group if t else None, "project": t.wandb_project if t else None}

    async def latest_example(request: web.Request) -> web.Response:
        body = request.app[API_KEY]._latest_body
        if body is None:
            return json_response({"tokens": [], "masks": [], "scores": []})
        return web.Response(body=body, content_type="application/json")

    app.add_routes([
        web.get("/", get(lambda api: {"message": "Lachesis rollout API"})),
        web.get("/health", get(lambda api: {"status": "ok"})),
        web.post("/register", handle_register),
        web.post("/register-env", handle_register_env),
        web.post("/disconnect-env", handle_disconnect_env),
        web.get("/wandb_info", get(wandb_info)),
        web.get("/info", get(info)),
        web.post("/scored_data", handle_scored_data),
        web.post("/scored_data_list", handle_scored_data_list),
        web.get("/batch", handle_batch),
        web.get("/status", get(RolloutAPI.status)),
        web.get("/status-env", handle_status_env),
        web.get("/latest_example", latest_example),
        web.post("/reset_data", handle_reset),
        web.post("/lease", handle_lease),
        web.post("/ack", handle_ack),
        web.post("/nack", handle_nack),
        web.get("/dead_letters", handle_dead_letters),
        web.post("/policy_version", handle_policy_version),
        web.post("/resume", handle_resume),
        web.post("/checkpoint", handle_checkpoint),
        web.get("/accounting", handle_accounting),
        web.get("/counters", get(lambda api: dict(sorted(api.counters.items())))),
    ])
    return app


def serve(config: APIConfig) -> None:
    """Run the API until interrupted (``lachesis api``)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    app = build_app(config)
    where = "memory (nothing survives a restart)" if config.in_memory else config.db
    log.info("rollout API on http://%s:%d, queue in %s%s", config.host, config.port, where,
             ", bearer token required" if config.token else "")
    web.run_app(app, host=config.host, port=config.port, access_log=None, print=None)
