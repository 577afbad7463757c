"""Watch a flow run another worker executes until it ends, or until its heartbeat says it is lost.

Prefect keeps a flow run Running for ever when its process dies with its node: nothing is left to report a
final state. The run's heartbeat (`draftsmith.core.heartbeat`, in the run folder both sides reach) tells a
live run from a lost one; `watch` reads both, `mark_crashed` then tells Prefect what became of a lost run. The
dispatching side (`draftsmith.flows.dispatch`) decides what to do about it: start it again or fail.
"""

import time
from typing import TYPE_CHECKING, Any

from draftsmith.core import heartbeat
from draftsmith.core.config.stages import DispatchConfig

if TYPE_CHECKING:
    from prefect.client.schemas.objects import FlowRun

# How often the run's state and heartbeat are read (at most; sooner for faster beats).
POLL_S = 5.0


class WatchError(RuntimeError):
    """The watched run was deleted, or the Prefect server stayed away too long; one line naming the run."""


def watch(client: Any, child: "FlowRun", stage: str, run_dir: str, cfg: DispatchConfig) -> tuple["FlowRun", str | None]:
    """Poll `child` (a flow run of `stage`, beating under `run_dir`) until it is final (it, None) or lost (it,
    why in words).

    Lost: Running while its heartbeat has not changed for `cfg.lost_after_s`, so detection takes at most that
    plus two polls after the process died. Scheduled or Pending is waiting for a worker, not lost. A server that
    does not answer (restarting) is asked again for as long.
    """
    import httpx
    from prefect.exceptions import ObjectNotFound

    poll_s = min(POLL_S, cfg.heartbeat_s)
    seen: Any = object()  # the last heartbeat record, and when it was first seen (this clock)
    since = unreachable = time.monotonic()
    while True:
        try:
            run = client.read_flow_run(child.id)
        except ObjectNotFound:
            raise WatchError(f"stage {stage}: flow run {child.name} ({child.id}) was deleted while it ran") from None
        except httpx.HTTPError as err:
            if time.monotonic() - unreachable > cfg.lost_after_s:
                raise WatchError(
                    f"stage {stage}: the Prefect server did not answer for {cfg.lost_after_s:.0f} s while flow run "
                    f"{child.name} ({child.id}) ran: {type(err).__name__}"
                ) from None
            time.sleep(poll_s)
            continue
        unreachable = now = time.monotonic()
        if run.state is not None and run.state.is_final():
            return run, None
        if run.state is None or not run.state.is_running():
            seen, since = object(), now  # the clock starts when it runs
        else:
            beat = heartbeat.read_beat(run_dir, stage)
            mine = beat if beat is not None and beat.get("flow_run") == str(child.id) else None
            if mine != seen:
                seen, since = mine, now
            elif now - since > cfg.lost_after_s:
                last = f"last beat at {mine['at']} from pid {mine['pid']} on {mine['host']}" if mine else "no beat"
                return run, f"Running, but its heartbeat stood still for {now - since:.0f} s ({last})"
        time.sleep(poll_s)


def mark_crashed(client: Any, child: "FlowRun", why: str) -> None:
    """Tell Prefect what became of the run, so the UI and the next scheduler see it ended; forced, because
    nothing else is left to report its final state."""
    from prefect.states import Crashed

    client.set_flow_run_state(child.id, Crashed(message=f"lost by draftsmith's dispatch: {why}"), force=True)
