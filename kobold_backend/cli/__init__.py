"""The `kobold-backend` command line: `main` (the subcommand table, generate, doctor), `serve`, `split` (the
layer-split flags) and `model_args` (the options every model-loading subcommand shares). It owns argparse; the
engine, server and host never import it."""
