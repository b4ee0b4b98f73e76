"""The `paratron` commands, one module each with its parser (`parser()`) and its run (`run(argv) -> exit code`).

They sit above every other package and only `paratron.cli` imports them, one at a time: the one that runs.
`launching` holds what the commands that start workers share.
"""
