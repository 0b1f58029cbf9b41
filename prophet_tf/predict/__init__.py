"""Predict the step time of N workers from a one-worker profile, for every schedule.

    python -m prophet_tf.predict PROFILE.json --workers 2,4,8,16,64 --bandwidth 1G,10G,25G \
        --schedule all

A discrete-event model of the runtime (``ops/sim/simulator.h``) replays the runtime's own
scheduling policies, partitioning and owner assignment over a model of the links and the owners'
summation, and TensorFlow's MultiWorkerMirroredStrategy as the baseline. See
:mod:`prophet_tf.predict.profile` for how a profile is recorded, and :func:`predict`.
"""

from prophet_tf.predict.model import (FIXED_SCHEDULES, SCHEDULES, IdealBound, PredictError,
                                      Prediction, PredictOptions, SimulatedDeadlock, ideal_bound,
                                      kernel_autotuned_socket_buffer, kernel_socket_buffer_cap,
                                      parse_schedule, predict, predict_many)
from prophet_tf.predict.profile import (Profile, ProfiledLayer, ProfiledTensor, ProfileError,
                                        load_profile, profile_from_ready_times,
                                        profile_from_trace)

__all__ = ["FIXED_SCHEDULES", "SCHEDULES", "IdealBound", "PredictError", "Prediction", "PredictOptions",
           "Profile", "ProfiledLayer", "ProfiledTensor", "ProfileError",
           "kernel_autotuned_socket_buffer", "kernel_socket_buffer_cap",
           "load_profile",
           "SimulatedDeadlock", "ideal_bound", "parse_schedule", "predict", "predict_many", "profile_from_ready_times",
           "profile_from_trace"]
