"""The reference training as a script: `python examples/train_llama.py ...` is `picofx train ...`
(options: `picofx train --help`)."""
from picofx.cli.train import main

if __name__ == "__main__":
    main()
