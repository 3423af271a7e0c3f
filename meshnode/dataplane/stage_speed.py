"""What a step of this shard's range costs on this machine, as announced (``ServedShard.speed``).

Pure and synchronous. :class:`StageSpeedMeter` is fed two ways:

* a *calibration* before any traffic: the shard service times the bounded real forward it runs
  to validate a freshly loaded range (meshnode.dataplane.validation) and files it with
  :meth:`StageSpeedMeter.calibrate`, so a node announces an estimate from its first heartbeat;
* the engine's *live batches* afterwards (meshnode.dataplane.batch_stats calls
  :meth:`StageSpeedMeter.batch_finished`): a batch of decode steps only is a decode sample, a
  batch of prefill only a prefill sample; a mixed batch says nothing separable and is skipped.
  A batch that ran only the end of the range (routes trimmed to start inside it) is scaled to
  the whole range by the share of the range's work it ran (weight bytes a step reads, where
  the shard knows them, else layers): a tail replica that computes one layer and the output
  projection must not announce that as the time of its seven layers.

Each figure is an exponentially weighted moving average, so one slow batch (a page fault, a
neighbour's burst) moves it a little and a lasting change moves it within a few dozen batches.
The first live sample replaces the calibration outright: it measured the same range on the same
threads, under real load. Figures are clamped to what receivers accept
(:data:`~meshnode.mesh.validation.MAX_STAGE_US_PER_TOKEN`), so a node never announces a record
its peers would refuse.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshnode.mesh.validation import MAX_STAGE_US_PER_TOKEN
from meshnode.wire.pb import mesh

# Weight of the newest sample. 0.1 averages over roughly the last 20 batches: a decode step on a
# CPU node takes tens of milliseconds, so that is about a second of traffic.
SMOOTHING = 0.1
_NS_PER_US = 1_000


class Ewma:
    """An exponentially weighted moving average; None until the first sample."""

    def __init__(self, weight: float = SMOOTHING) -> None:
        if not 0.0 < weight <= 1.0:
            raise ValueError(f"an EWMA weight is within (0, 1], got {weight}")
        self.weight = weight
        self.value: float | None = None

    def observe(self, sample: float) -> float:
        self.value = sample if self.value is None else self.value + self.weight * (sample - self.value)
        return self.value

    def reset(self, value: float | None = None) -> None:
        self.value = value


@dataclass(frozen=True)
class StageSpeed:
    """One node's step times for its range, microseconds per token (0 prefill: none yet)."""

    decode_us_per_token: int
    prefill_us_per_token: int
    # Live batches behind the figures; 0 while they are the calibration's alone.
    samples: int
    measured: bool

    @property
    def decode_ms_per_token(self) -> float:
        return self.decode_us_per_token / 1_000

    def message(self) -> mesh.StageSpeed:
        return mesh.StageSpeed(
            decode_us_per_token=self.decode_us_per_token,
            prefill_us_per_token=self.prefill_us_per_token,
            samples=self.samples,
            source=mesh.STAGE_SPEED_SOURCE_MEASURED if self.measured else mesh.STAGE_SPEED_SOURCE_CALIBRATED,
        )

    @classmethod
    def of_message(cls, message: mesh.StageSpeed) -> StageSpeed:
        """The figures of a record that passed :func:`~meshnode.mesh.validation.validate_stage_speed`."""
        return cls(
            decode_us_per_token=message.decode_us_per_token,
            prefill_us_per_token=message.prefill_us_per_token,
            samples=message.samples,
            measured=message.source == mesh.STAGE_SPEED_SOURCE_MEASURED,
        )


def _announced_us(ns: float, *, at_least: int) -> int:
    return max(at_least, min(MAX_STAGE_US_PER_TOKEN, round(ns / _NS_PER_US)))


class StageSpeedMeter:
    def __init__(self, weight: float = SMOOTHING) -> None:
        self._decode_ns = Ewma(weight)
        self._prefill_ns = Ewma(weight)
        # Live samples of each kind: the first of a kind replaces the calibration's figure.
        self._decode_samples = 0
        self._prefill_samples = 0

    def calibrate(self, *, decode_ns_per_token: float, prefill_ns_per_token: float | None = None) -> None:
        """An estimate before traffic; ignored once live batches of that kind were measured."""
        if decode_ns_per_token > 0 and self._decode_samples == 0:
            self._decode_ns.reset(decode_ns_per_token)
        if prefill_ns_per_token is not None and prefill_ns_per_token > 0 and self._prefill_samples == 0:
            self._prefill_ns.reset(prefill_ns_per_token)

    def batch_finished(
        self, *, decodes: int, prefills: int, tokens: int, duration_ns: int, range_share: float = 1.0
    ) -> None:
        """A batch the engine ran: ``decodes`` decode steps and ``prefills`` prefill chunks of
        ``tokens`` tokens in all, in ``duration_ns``, over ``range_share`` of the range's work (a
        route that starts inside the range runs only its end: the sample is scaled to the whole
        range, which is what the node announces and what placement and routes price)."""
        if duration_ns <= 0 or tokens <= 0 or not 0.0 < range_share <= 1.0:
            return
        duration_ns = round(duration_ns / range_share)
        if prefills == 0 and decodes > 0:
            # Every session in the batch advanced by its tokens in the batch's time: a stream's
            # time per token is the duration over its share of the tokens (one, without drafts).
            self._decode_samples += 1
            per_token = duration_ns * decodes / tokens
            if self._decode_samples == 1:
                self._decode_ns.reset(per_token)
            else:
                self._decode_ns.observe(per_token)
        elif decodes == 0 and prefills > 0:
            self._prefill_samples += 1
            per_token = duration_ns / tokens
            if self._prefill_samples == 1:
                self._prefill_ns.reset(per_token)
            else:
                self._prefill_ns.observe(per_token)

    def speed(self) -> StageSpeed | None:
        """The figures to announce; None until a decode step was calibrated or measured."""
        decode = self._decode_ns.value
        if decode is None:
            return None
        prefill = self._prefill_ns.value
        return StageSpeed(
            decode_us_per_token=_announced_us(decode, at_least=1),
            prefill_us_per_token=0 if prefill is None else _announced_us(prefill, at_least=1),
            samples=min(self._decode_samples + self._prefill_samples, 2**32 - 1),
            measured=self._decode_samples > 0,
        )


def with_speed(served: mesh.ServedShard, speed: StageSpeed | None) -> mesh.ServedShard:
    """A copy of ``served`` announcing ``speed`` (none: the field left out)."""
    announced = mesh.ServedShard()
    announced.CopyFrom(served)
    if speed is None:
        announced.ClearField("speed")
    else:
        announced.speed.CopyFrom(speed.message())
    return announced


__all__ = ["SMOOTHING", "Ewma", "StageSpeed", "StageSpeedMeter", "with_speed"]
