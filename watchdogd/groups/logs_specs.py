"""A ``--logs-specs`` of the user's: torch's ``LogsSpecs``, asked where each attempt's logs go.

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

from watchdogd.core.ports import GroupError
from watchdogd.groups.helper_process import HelperError, TorchHelper
from watchdogd.groups.torch_wire import LoadLogsSpecs, Opened, Reified, Reify
from watchdogd_client.groups import GroupSpec

__all__ = ["CustomLogsSpecs"]


class CustomLogsSpecs:
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
