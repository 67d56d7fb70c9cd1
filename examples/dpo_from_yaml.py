"""DPO from a YAML file with the Tier 2 factory: ``python examples/dpo_from_yaml.py [key.path=value ...]``."""

import sys

from trainer_core import build_trainer, load_config

config = load_config("examples/dpo.yaml", overrides=sys.argv[1:])
for stage in ("prepare_data", "sft", "dpo"):  # each reads what the one before committed
    manifest = build_trainer(config, stage, run_id="dpo-example").run()
    print(f"{stage}: committed at global_step {manifest.global_step}", flush=True)
print({k: round(v, 4) for k, v in sorted(manifest.metrics.items()) if k.startswith("eval/")})
