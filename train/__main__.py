"""`python -m train JOB.yaml`: run one stage by hand, from a resolved TrainJob (a run folder's config.yaml)."""

import logging
import sys
from pathlib import Path

import yaml

from train.config import TrainJob
from train.recipe import run_stage

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if len(sys.argv) != 2:
        sys.exit("usage: python -m train path/to/job.yaml")
    job = TrainJob.model_validate(yaml.safe_load(Path(sys.argv[1]).read_text()))
    print(run_stage(job))
