"""``python -m fusectl``: the same command line as the ``fusectl`` script, for environments
where the script is not on PATH."""

from .cli import entry

if __name__ == "__main__":
    entry()
