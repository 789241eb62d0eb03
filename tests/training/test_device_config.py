"""A config.yaml saved on one device and reused on another (issue 32, finding 10): a run on the CPU
saves its resolved defaults (step_compiler dynamo-full); on a Neuron device, whose default is lazy
because torch.compile training on torch-neuronx 2.9 is not yet supported, the file's value is said.
The device kind is given to build_config, as a Neuron machine's PJRT device would give it: this
tests how the configuration is resolved, not a Neuron device."""

from __future__ import annotations

from neuron_train.training.config_io import build_config, load_config_file, save_config


def test_a_config_saved_on_cpu_warns_when_reused_on_neuron(tmp_path, capsys):
    saved = tmp_path / "config.yaml"
    save_config(build_config(device_kind="CPU"), saved)  # what a CPU run writes into its run folder
    assert capsys.readouterr().err == ""
    values = load_config_file(saved)
    cfg = build_config(values, device_kind="NEURON", source=str(saved))
    err = capsys.readouterr().err
    assert f"neuron-train: warning: {saved}: train.step_compiler is 'dynamo-full', but on this device (NEURON) " \
           "the default is lazy" in err
    assert "optim.optimizer_impl is 'foreach'" in err and err.count("\n") == 2  # one line per setting
    assert cfg.train.step_compiler == "dynamo-full"  # the file is obeyed, and said

    build_config(values, {"train.step_compiler": "dynamo-full", "optim.optimizer_impl": "foreach"},
                 device_kind="NEURON")  # chosen on the command line: nothing to say
    build_config(values, device_kind="CPU")  # the same device
    assert capsys.readouterr().err == ""
