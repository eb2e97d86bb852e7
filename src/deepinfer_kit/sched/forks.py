"""Fork children for ``n > 1``: completion ``j`` of a request as a sequence of its own."""

from __future__ import annotations

from deepinfer_kit.outputs import RequestMetrics
from deepinfer_kit.request import Request, RequestStatus, fork_seed

__all__ = ["child_id", "spawn_child", "will_fork"]


def child_id(parent_id: str, index: int) -> str:
    """The sequence id of completion ``index`` (``>= 1``) of ``parent_id``."""
    return f"{parent_id}#{index}"


def spawn_child(parent: Request, index: int, num_computed_tokens: int) -> Request:
    """Completion ``index`` of ``parent``, created when the parent's first sample lands.

    The child copies the parent's prompt, parameters, arrival, EOS, priority, cache
    context and cached-token count; it gets its own seed (:func:`fork_seed`), its own
    metrics (arrival and first scheduling copied) and starts RUNNING with the prompt's
    ``num_computed_tokens`` and no generated token yet. It holds no blocks: the caller
    gives it the parent's by ``KVCacheManager.fork``. The parent is not mutated; its
    observer, when it has one, forks one for the child.
    """
    parent_metrics = parent.metrics
    metrics = RequestMetrics(
        arrival_time=parent.arrival_time,
        first_scheduled_time=parent_metrics.first_scheduled_time if parent_metrics else None,
    )
    child = Request(
        request_id=child_id(parent.request_id, index),
        prompt_token_ids=parent.prompt_token_ids,
        params=parent.params,
        arrival_time=parent.arrival_time,
        eos_token_id=parent.eos_token_id,
        priority=parent.priority,
        parent_id=parent.request_id,
        index=index,
        seed=fork_seed(parent.seed, index),
        prompt_text=parent.prompt_text,
        all_token_ids=parent.all_token_ids[: parent.num_prompt_tokens],
        status=RequestStatus.RUNNING,
        num_computed_tokens=num_computed_tokens,
        num_cached_tokens=parent.num_cached_tokens,
        cache_context=parent.cache_context,
        metrics=metrics,
    )
    if parent.observer is not None:
        child.observer = parent.observer.fork(child)
    return child


def will_fork(request: Request) -> bool:
    """True when the request's next sample starts its ``n`` completions: an ``n > 1``
    request (not itself a child) that has generated nothing yet."""
    return request.params.n > 1 and request.parent_id is None and not request.output_token_ids
