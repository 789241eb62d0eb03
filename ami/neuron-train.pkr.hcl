# A trn1/inf2 machine image for neuron-train: the pinned Neuron SDK, EFA, this project in a venv,
# and optionally a pre-warmed compile cache. Provisioned by ami/provision.sh (which also works
# alone as EC2 user-data). Usage: docs/ami.md.
#
#   packer init ami/ && packer build -var region=us-west-2 ami/
#
# Versions live in one place, neuron_train/data/neuron_versions.json: `neuron_sdk` picks a
# release from it (its default is that file's pin; tests/test_ami.py keeps the two equal).

packer {
  required_plugins {
    amazon = {
      source  = "github.com/hashicorp/amazon"
      version = ">= 1.3.0"
    }
  }
}

variable "neuron_sdk" {
  type        = string
  default     = "2.29.1"
  description = "Neuron SDK release to install: a key of `releases` in neuron_train/data/neuron_versions.json."
}

variable "base" {
  type        = string
  default     = "ubuntu"
  description = "ubuntu: Canonical Ubuntu 22.04, nothing of Neuron pre-installed (provision.sh installs the pinned release); dlami: the Deep Learning Base Neuron AMI (Ubuntu 22.04). Either is found by its publisher's SSM parameter (below) unless base_ami_id pins an image."
  validation {
    condition     = contains(["dlami", "ubuntu"], var.base)
    error_message = "The base must be \"dlami\" or \"ubuntu\"."
  }
}

variable "dlami_ssm_parameter" {
  type        = string
  default     = "/aws/service/neuron/dlami/base/ubuntu-22.04/latest/image_id"
  description = "With base = dlami: the SSM parameter Neuron publishes for the newest Base DLAMI (Ubuntu 22.04), as Neuron's release notes point to. It resolves per region at build time; a DLAMI newer than the pinned SDK brings a newer driver and runtime that provision.sh re-pins (apt --allow-downgrades)."
}

variable "ubuntu_ssm_parameter" {
  type        = string
  default     = "/aws/service/canonical/ubuntu/server/22.04/stable/current/amd64/hvm/ebs-gp2/ami-id"
  description = "With base = ubuntu: Canonical's SSM parameter for the current Ubuntu 22.04 server image."
}

variable "base_ami_id" {
  type        = string
  default     = ""
  description = "A pinned base image id (ami-..., of this region), used instead of the SSM parameter: record the date and the name it had (aws ec2 describe-images --image-ids ID) where you keep the build command. Packer still reads one SSM parameter (Canonical's, present in every region): the build needs ssm:GetParameter."
  validation {
    condition     = var.base_ami_id == "" || can(regex("^ami-[0-9a-f]{8,17}$", var.base_ami_id))
    error_message = "base_ami_id must be an AMI id (ami-...) or empty."
  }
}

variable "region" {
  type    = string
  default = "us-west-2"
}

variable "instance_type" {
  type        = string
  default     = "trn1.2xlarge"
  description = "Build on the hardware you train on: doctor then checks the devices, and pre-warmed graphs match."
}

variable "subnet_id" {
  type        = string
  default     = ""
  description = "Subnet for the build instance (empty: the default VPC)."
}

variable "volume_size_gb" {
  type        = number
  default     = 512
  description = "Root volume; the Neuron setup guide asks for at least 512 GB on Trn1."
}

variable "encrypt_boot" {
  type    = bool
  default = true
}

variable "install_efa" {
  type        = string
  default     = "auto"
  description = "auto (install when the base lacks it), yes, or no."
}

variable "prewarm_train_args" {
  type        = string
  default     = ""
  description = "Train flags to precompile into /var/tmp/neuron-train/compile_cache (empty: no pre-warm)."
}

variable "prewarm_nprocs" {
  type        = string
  default     = ""
  description = "With prewarm_train_args: the processes per node you train with, one precompile each (\"32\" on trn1.32xlarge, \"1 32\" for both). The world size is part of every graph; a multi-node world is pre-warmed by its own job (scripts/slurm_train.sbatch, NEURON_TRAIN_PREWARM=1)."
  validation {
    condition     = can(regex("^[0-9 ]*$", var.prewarm_nprocs))
    error_message = "prewarm_nprocs must be process counts separated by spaces, e.g. \"1 32\"."
  }
}

variable "ami_name_prefix" {
  type    = string
  default = "neuron-train"
}

# The base image's id from its publisher's SSM parameter (needs ssm:GetParameter), read at build time.
# Packer reads a data source even when base_ami_id pins the image: then it reads Canonical's Ubuntu
# parameter, published in every region, so a pinned build never fails on the DLAMI's parameter
# (unused, and perhaps absent in the region). The build needs ssm:GetParameter in either case.
data "amazon-parameterstore" "base" {
  name   = var.base == "dlami" && var.base_ami_id == "" ? var.dlami_ssm_parameter : var.ubuntu_ssm_parameter
  region = var.region
}

locals {
  project_dir = "${path.root}/.."
  pins        = jsondecode(file("${local.project_dir}/neuron_train/data/neuron_versions.json"))
  release     = local.pins.releases[var.neuron_sdk]
  source_ami  = var.base_ami_id != "" ? var.base_ami_id : data.amazon-parameterstore.base.value
  stamp       = formatdate("YYYYMMDDhhmm", timestamp())
  tarball     = "${path.root}/build/neuron-train-src.tar.gz"
}

source "amazon-ebs" "neuron" {
  region          = var.region
  instance_type   = var.instance_type
  subnet_id       = var.subnet_id == "" ? null : var.subnet_id
  ami_name        = "${var.ami_name_prefix}-sdk${var.neuron_sdk}-${var.base}-${local.stamp}"
  ami_description = "neuron-train on Neuron SDK ${var.neuron_sdk} (torch-neuronx ${local.release["torch-neuronx"]}), Ubuntu 22.04"
  ssh_username    = "ubuntu"

  source_ami      = local.source_ami

  # IMDSv2 only: on the build instance, and on every instance launched from the image.
  metadata_options {
    http_endpoint               = "enabled"
    http_tokens                 = "required"
    http_put_response_hop_limit = 1
  }
  imds_support = "v2.0"

  # SSH to the build instance from this machine's address only; no build key left in the image.
  temporary_security_group_source_public_ip = true
  ssh_clear_authorized_keys                 = true

  launch_block_device_mappings {
    device_name           = "/dev/sda1"
    volume_size           = var.volume_size_gb
    volume_type           = "gp3"
    delete_on_termination = true
    encrypted             = var.encrypt_boot
  }
  encrypt_boot = var.encrypt_boot

  tags = {
    Name              = "${var.ami_name_prefix}-sdk${var.neuron_sdk}"
    neuron_sdk        = var.neuron_sdk
    torch_neuronx     = local.release["torch-neuronx"]
    neuronx_cc        = local.release["neuronx-cc"]
    aws_neuronx_dkms  = local.release["aws-neuronx-dkms"]
    base              = var.base
    base_ami          = local.source_ami
    prewarmed_for     = substr(var.prewarm_train_args, 0, 255) # tag values stop at 256 characters
    prewarmed_nprocs  = var.prewarm_nprocs
  }
}

build {
  sources = ["source.amazon-ebs.neuron"]

  # The project as source files (what `pip install` needs, plus scripts/ for pre-warming).
  provisioner "shell-local" {
    inline = [
      "mkdir -p '${path.root}/build'",
      "tar -C '${local.project_dir}' --exclude='__pycache__' --exclude='*.pyc' -czf '${local.tarball}' pyproject.toml README.md neuron_train scripts",
    ]
  }

  provisioner "file" {
    source      = local.tarball
    destination = "/tmp/neuron-train-src.tar.gz"
  }

  provisioner "shell" {
    script          = "${path.root}/provision.sh"
    execute_command = "chmod +x '{{ .Path }}'; sudo env {{ .Vars }} '{{ .Path }}'"
    environment_vars = [
      "NT_SRC=/tmp/neuron-train-src.tar.gz",
      "NT_NEURON_SDK=${var.neuron_sdk}",
      "NT_EFA=${var.install_efa}",
      "NT_PREWARM_ARGS=${var.prewarm_train_args}",
      "NT_PREWARM_NPROCS=${var.prewarm_nprocs}",
    ]
  }

  provisioner "shell" {
    inline = ["rm -f /tmp/neuron-train-src.tar.gz"]
  }

  post-processor "manifest" {
    output     = "${path.root}/build/manifest.json"
    strip_path = true
    custom_data = {
      neuron_sdk    = var.neuron_sdk
      torch_neuronx = local.release["torch-neuronx"]
    }
  }
}
