"""The scheduling policies (SchedulerConfig.policy, vLLM's scheduling_policy): where a request
enters the waiting queue, and which running request gives its blocks back when one more must be
found. "fcfs": arrival order, preempted requests first again; "priority": (priority, arrival)
order, lowest first, and the victim is the running request last in that order."""

from collections import deque

from jvllm.core.request import Request


def enqueue(waiting: deque[Request], request: Request, policy: str, front: bool = False) -> None:
    """`request` into `waiting`: at the back (a new request) or the front (a preempted one)
    under FCFS; under the priority policy after every request that sorts before or with it."""
    if policy == "priority":
        # From the back: a new request usually sorts last, so adding n costs O(n), not n^2.
        key = _priority_key(request)
        index = len(waiting)
        while index > 0 and _priority_key(waiting[index - 1]) > key:
            index -= 1
        waiting.insert(index, request)
    elif front:
        waiting.appendleft(request)
    else:
        waiting.append(request)


def pick_victim(running: list[Request], policy: str) -> Request:
    """The running request that gives its blocks back: the newest (FCFS), or the last in
    (priority, arrival time) order, as vLLM picks; of equal keys (n > 1 siblings), the newest."""
    if policy == "priority":
        return max(reversed(running), key=_priority_key)
    return running[-1]


def _priority_key(request: Request) -> tuple[int, float]:
    return request.priority, request.arrival_time
