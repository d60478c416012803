"""The model catalog: seeded models built from their architectures, their example inputs and sample requests.

One source of models among others (a user's own archive is another); it imports nothing of this project.
"""

from pathlib import Path

# Where the archiver writes the catalog's archives, and TorchServe's model store in the demo and tests.
ARCHIVE_DIR = Path(__file__).with_name("archives")
