"""`lmms-train check-data CONFIG [--num-records N]`: the data path of a run without its model.

Reads the first N records of `dataset_config` through the family's data plan, with the same
readers, record adapter, media resolution and processor (or latent loader) the training run
uses (one process, no workers, no shuffle), and prints what a user needs to see before spending
a GPU hour (`DataReport`): records/s, token lengths, supervised share, media counts, how many
fit `packing_length` (latent batches: their bucket shapes), bad records by reason with an
example each, and one sample rendered with its supervised spans marked `[[...]]`.
"""

from __future__ import annotations

from lmms_train._data_report import DataReport, render_sample
from lmms_train._errors import UserError
from lmms_train.config import TrainConfig

__all__ = ["DataReport", "check_data", "render_sample"]


def check_data(cfg: TrainConfig, num_records: int = 200) -> DataReport:
    """Process the first `num_records` records of the run's data and measure them."""
    from lmms_train._data_setup import data_source, prepare_inputs
    from lmms_train._dist import DistEnv
    from lmms_train._model_setup import resolve_spec

    if num_records < 1:
        raise UserError("check-data: --num-records must be >= 1")
    spec = resolve_spec(cfg)
    env = DistEnv()
    prepare_inputs(cfg, env, spec)
    return data_source(cfg, spec, env).check(num_records)
