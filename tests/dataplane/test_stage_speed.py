"""A shard's announced speed: the smoothing, the calibration and what is announced."""

import pytest

from meshnode.dataplane.batch_stats import BatchStats
from meshnode.dataplane.stage_speed import Ewma, StageSpeed, StageSpeedMeter, with_speed
from meshnode.mesh.validation import MAX_STAGE_US_PER_TOKEN, validate_stage_speed
from meshnode.wire.pb import mesh, shard

MS = 1_000_000


def test_an_ewma_starts_at_its_first_sample_and_moves_by_its_weight():
    average = Ewma(0.25)
    assert average.value is None
    assert average.observe(8.0) == 8.0
    assert average.observe(16.0) == 10.0  # 8 + 0.25 * (16 - 8)
    assert average.observe(10.0) == 10.0
    with pytest.raises(ValueError):
        Ewma(0.0)


def test_nothing_is_announced_before_a_calibration_or_a_decode_batch():
    meter = StageSpeedMeter()
    assert meter.speed() is None
    meter.batch_finished(decodes=0, prefills=1, tokens=8, duration_ns=8 * MS)
    assert meter.speed() is None  # a prefill alone says nothing of decode


def test_a_calibration_is_an_estimate_until_the_first_live_batch_replaces_it():
    meter = StageSpeedMeter(weight=0.5)
    meter.calibrate(decode_ns_per_token=40 * MS, prefill_ns_per_token=4 * MS)
    assert meter.speed() == StageSpeed(40_000, 4_000, samples=0, measured=False)
    meter.batch_finished(decodes=1, prefills=0, tokens=1, duration_ns=20 * MS)
    # The first live decode replaces the estimate; the prefill estimate stays until measured.
    assert meter.speed() == StageSpeed(20_000, 4_000, samples=1, measured=True)
    meter.batch_finished(decodes=1, prefills=0, tokens=1, duration_ns=30 * MS)
    assert meter.speed() == StageSpeed(25_000, 4_000, samples=2, measured=True)
    # A later calibration (a reload of the validation) does not override live figures.
    meter.calibrate(decode_ns_per_token=90 * MS)
    assert meter.speed() == StageSpeed(25_000, 4_000, samples=2, measured=True)


def test_batches_are_sampled_by_kind_and_mixed_ones_skipped():
    meter = StageSpeedMeter(weight=0.5)
    # Two sessions decoding one token each in 12 ms: 12 ms per token for each stream.
    meter.batch_finished(decodes=2, prefills=0, tokens=2, duration_ns=12 * MS)
    # One session verifying three drafted tokens and another decoding one: 4 tokens, 2 streams.
    meter.batch_finished(decodes=2, prefills=0, tokens=4, duration_ns=16 * MS)  # 8 ms per token
    # A prefill of 100 tokens in 50 ms.
    meter.batch_finished(decodes=0, prefills=1, tokens=100, duration_ns=50 * MS)
    # Mixed, empty and timeless batches are not samples.
    meter.batch_finished(decodes=1, prefills=1, tokens=9, duration_ns=90 * MS)
    meter.batch_finished(decodes=1, prefills=0, tokens=0, duration_ns=90 * MS)
    meter.batch_finished(decodes=1, prefills=0, tokens=1, duration_ns=0)
    assert meter.speed() == StageSpeed(10_000, 500, samples=3, measured=True)


def test_announced_figures_are_clamped_to_what_receivers_accept():
    meter = StageSpeedMeter()
    meter.calibrate(decode_ns_per_token=10, prefill_ns_per_token=10**15)
    speed = meter.speed()
    assert speed == StageSpeed(1, MAX_STAGE_US_PER_TOKEN, samples=0, measured=False)
    validate_stage_speed(speed.message())  # refused otherwise


def test_the_speed_rides_in_the_served_shard_and_reads_back():
    served = mesh.ServedShard(model_name="m", shard_range=shard.ShardRange(start_layer=0, end_layer=4))
    speed = StageSpeed(12_345, 678, samples=9, measured=True)
    announced = with_speed(served, speed)
    assert not served.HasField("speed")  # a copy; the original is untouched
    assert announced.speed == mesh.StageSpeed(
        decode_us_per_token=12_345,
        prefill_us_per_token=678,
        samples=9,
        source=mesh.STAGE_SPEED_SOURCE_MEASURED,
    )
    assert StageSpeed.of_message(announced.speed) == speed
    assert not with_speed(announced, None).HasField("speed")


def test_a_batch_that_ran_the_end_of_the_range_is_scaled_to_the_whole_range():
    # A route entering a 7-layer range at its last layer: that layer and the output projection
    # took 30 ms, a quarter of the range's work; the range's step is announced as 120 ms.
    meter = StageSpeedMeter()
    meter.batch_finished(decodes=1, prefills=0, tokens=1, duration_ns=30 * MS, range_share=0.25)
    assert meter.speed() == StageSpeed(120_000, 0, samples=1, measured=True)
    # A share outside (0, 1] is no sample.
    meter.batch_finished(decodes=1, prefills=0, tokens=1, duration_ns=30 * MS, range_share=0.0)
    meter.batch_finished(decodes=1, prefills=0, tokens=1, duration_ns=30 * MS, range_share=1.5)
    assert meter.speed() == StageSpeed(120_000, 0, samples=1, measured=True)


def test_batch_stats_price_the_share_of_the_range_each_step_ran():
    stats = BatchStats()
    # Range [5, 12): six layers of 90 and, at the end, one of 90 with an output of 131 (the
    # weight bytes a step reads, in MB).
    stats.range_work = lambda start, end: 90.0 * (end - start) + (131.0 if end == 12 else 0.0)
    stats.started(decodes=1, prefills=0, tokens=1, waits_ns=[0], now_ns=0, ranges=[(5, 12, 11)])
    stats.finished(now_ns=221 * MS)
    # 221 ms for 221 of the range's 761: the range's step is 761 ms.
    speed = stats.speed.speed()
    assert speed is not None and speed.decode_us_per_token == 761_000
    # By layers alone (the default pricing), the same batch would read as 7x its time.
    by_layers = BatchStats()
    by_layers.started(decodes=1, prefills=0, tokens=1, waits_ns=[0], now_ns=0, ranges=[(5, 12, 11)])
    by_layers.finished(now_ns=100 * MS)
    speed = by_layers.speed.speed()
    assert speed is not None and speed.decode_us_per_token == 700_000
    # A batch over the whole range is taken as it is.
    whole = BatchStats()
    whole.started(decodes=1, prefills=0, tokens=1, waits_ns=[0], now_ns=0, ranges=[(5, 12, 5)])
    whole.finished(now_ns=100 * MS)
    speed = whole.speed.speed()
    assert speed is not None and speed.decode_us_per_token == 100_000
