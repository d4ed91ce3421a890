"""Where each attempt's logs go: watchdogd's own layout, or a ``--logs-specs`` of the user's.

Both are a :class:`LogLayout` the runner asks before each attempt.
:class:`OwnLogs` follows the spec's ``log_dir``, ``redirects`` and ``tee``
as torchrun reads them, and owns each rank's error file.
:class:`CustomLogsSpecs` is torch's ``LogsSpecs``, asked where each
attempt's logs go.

torchrun finds the class among the ``torchrun.logs_specs`` entry points,
makes it from ``--log-dir``, ``--redirects``, ``--tee`` and
``--local-ranks-filter``, and calls its ``reify(envs)`` before each
attempt. So does this, in a torch helper of the daemon's own interpreter
(where the entry point was found): the class is someone's code, and
subclasses torch's, so neither runs in the daemon. The group's workers
wait on that call once per attempt (milliseconds once the helper runs; its
start, with torch's import, comes before the first attempt).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path

from watchdogd.core.ports import GroupError
from watchdogd.core.workerenv import (
    StreamRoute,
    attempt_dir,
    routes_from_logs_dest,
    stream_routes,
)
from watchdogd.groups.features import Feature
from watchdogd.groups.helper_process import HelperError, TorchHelper
from watchdogd.groups.torch_wire import LoadLogsSpecs, Opened, Reified, Reify
from watchdogd_client.groups import GroupSpec

__all__ = ["CustomLogsSpecs", "LogLayout", "OwnLogs", "Routes"]

Routes = dict[int, tuple[StreamRoute, StreamRoute]]
"""Per local rank, its (stdout, stderr) routes."""


class LogLayout(Feature, ABC):
    @abstractmethod
    async def routes(
        self, attempt: int, envs: dict[int, dict[str, str]], base: dict[str, str]
    ) -> Routes:
        """Each rank's streams for ``attempt``; it may set variables in ``envs``
        (inherited from ``base``, unless set)."""

    def clear_error_file(self, env: dict[str, str]) -> None:
        """Ready the rank's error file (blocks: called in a thread)."""


class OwnLogs(LogLayout):
    """watchdogd's layout: the error file is ours, beside the rank's logs."""

    def __init__(self, spec: GroupSpec) -> None:
        self.spec = spec

    async def routes(
        self, attempt: int, envs: dict[int, dict[str, str]], base: dict[str, str]
    ) -> Routes:
        return stream_routes(self.spec, attempt_dir(self.spec, attempt))

    def clear_error_file(self, env: dict[str, str]) -> None:
        error_path = Path(env["TORCHELASTIC_ERROR_FILE"])
        error_path.parent.mkdir(parents=True, exist_ok=True)  # the rank's log dir too
        error_path.unlink(missing_ok=True)  # an earlier run's, in a log dir used again


class CustomLogsSpecs(LogLayout):
    """The group's ``LogsSpecs``, started on the first :meth:`reify`."""

    def __init__(self, spec: GroupSpec, name: str) -> None:
        self.spec = spec
        self.name = name
        self.helper = TorchHelper(None)
        self._loaded = False

    def _error(self, why: object) -> GroupError:
        return GroupError(f"group {self.spec.name}: logs_specs {self.name!r}: {why}")

    async def reify(self, envs: dict[int, dict[str, str]]) -> Reified:
        """``LogsSpecs.reify(envs)``: the attempt's files, and ``envs`` as it left them."""
        try:
            if not self._loaded:
                await self._load()
            return await self.helper.call(Reify(envs=envs), Reified)
        except HelperError as e:
            raise self._error(e) from None

    async def routes(
        self, attempt: int, envs: dict[int, dict[str, str]], base: dict[str, str]
    ) -> Routes:
        # torch's agent hands reify its own variables, not the environment they inherit.
        own = {
            rank: {k: v for k, v in env.items() if base.get(k) != v} for rank, env in envs.items()
        }
        reified = await self.reify(own)
        for rank, env in envs.items():
            env.update(reified.envs.get(rank, {}))
        return routes_from_logs_dest(self.spec, reified.dest)

    async def _load(self) -> None:
        ready = await self.helper.start()
        if not ready.torch:
            raise self._error(f"a LogsSpecs is torch's class, and {ready.python} has no torch")
        spec = self.spec
        request = LoadLogsSpecs(
            name=self.name,
            log_dir=spec.log_dir,
            redirects=spec.redirects,
            tee=spec.tee,
            local_ranks_filter=spec.local_ranks_filter,
        )
        await self.helper.call(request, Opened)
        self._loaded = True

    async def aclose(self) -> None:
        await self.helper.aclose()
