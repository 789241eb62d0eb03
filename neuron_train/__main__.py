import sys

from neuron_train.cli import main

sys.exit(main())
