"""``python -m logitless.integrations.nemo_rl SCRIPT ARGS``: NeMo RL's launch script with
logitless installed (:func:`logitless.integrations.nemo_rl.main`)."""

from . import main

if __name__ == "__main__":
    main()
