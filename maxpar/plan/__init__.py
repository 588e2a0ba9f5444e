"""`python -m maxpar.plan`: predict a config's communication, compute, memory and bubble; prove it.

Modules: hardware (profiles, torus layout), layout (the trainer's shardings on an
abstract mesh), model_math (parameters, FLOPs, memory), comms (the seeds'
per-strategy collectives), rooflines (the seeds' closed forms), predict (the
plan), recommend (mesh search), hlo (collectives of a compiled program), verify
(predicted vs compiled), report (tables, JSON).
"""
