#pragma once
// Training on DTensors: the trainers of any model of nn's contract (train/trainer.hpp: nn::DdpTrainer,
// nn::FsdpTrainer; train/pipeline_trainer.hpp: nn::PipelineTrainer; train/data_layout.hpp: a layout name to
// its mesh and trainer) and what they are made of: FSDP / HSDP groups (fsdp.hpp, flat_layout.hpp) and their
// schedule (fsdp_schedule.hpp), DDP's bucketed asynchronous gradient reduction (ddp.hpp), optimizers on
// sharded parameters (optim.hpp: SGD, AdamW) and learning-rate schedules (lr_schedule.hpp), gradient clipping
// by the global norm (clip.hpp), pipeline schedules and their runner (pipeline_schedule.hpp,
// pipeline_run.hpp), the layouts of a model planned from dry runs (plan_layouts.hpp), and the training
// state's save and resume (train_state.hpp, with dtensor::checkpoint).
// The models and layers are <dtensor/nn.hpp>.

#include "dtensor/train/clip.hpp"
#include "dtensor/train/data_layout.hpp"
#include "dtensor/train/ddp.hpp"
#include "dtensor/train/flat_layout.hpp"
#include "dtensor/train/fsdp.hpp"
#include "dtensor/train/fsdp_schedule.hpp"
#include "dtensor/train/lr_schedule.hpp"
#include "dtensor/train/optim.hpp"
#include "dtensor/train/pipeline_run.hpp"
#include "dtensor/train/pipeline_schedule.hpp"
#include "dtensor/train/pipeline_trainer.hpp"
#include "dtensor/train/plan_layouts.hpp"
#include "dtensor/train/trainer.hpp"
