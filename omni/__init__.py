"""vLLM-Omni beside the trainer: its CPU test environment (setup_env.sh), the tiny servers the tests start, and the
pipelines that run inside its servers (`pipeline*.py`, named `omni.pipeline.FlowGRPO…` in a server's
`--custom-pipeline-args`; never imported by the trainer)."""
