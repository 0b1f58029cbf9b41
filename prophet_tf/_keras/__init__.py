"""The Keras 3 integration of :class:`prophet_tf.ProphetStrategy`.

Hooks into Keras (``patches``, ``loss_normalization``), collective saving (``saving``), one
``fit``'s position, resume and preemption stop (``fit_session``) and the step report
(``step_report``). The strategy imports this package; nothing here imports the strategy.
"""
