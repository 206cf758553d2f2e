"""The root-cause report's traceback keeps an exception's whole message: TensorFlow's and
Keras's errors say what went wrong, and on which of the user's lines, after their first line.

The texts are what TensorFlow 2.21 / Keras 3.15 printed for a ``tf.function`` that fails
while it is traced (a reshape to a wrong shape), one that fails while it runs (a gather out
of range), and a ``model.fit`` on inputs of the wrong shape; only the site-packages path is
shortened. After each comes what a trainer's stderr may hold next (EDDIS's line, a TensorFlow
log line), which is not part of the message.
"""
from eddis.launch.output import (LAST_FRAME_LINES, LAST_MESSAGE_LINES, MAX_MESSAGE_LINES, MAX_TRACEBACK_LINES,
                                 MESSAGE_SCAN_LINES, TracebackCatcher)

SITE = "/venv/lib/python3.11/site-packages"

IN_USER_CODE = f"""\
Traceback (most recent call last):
  File "/work/train.py", line 8, in <module>
    step(tf.zeros([4, 4]))
  File "{SITE}/tensorflow/python/util/traceback_utils.py", line 167, in error_handler
    raise e.with_traceback(filtered_tb) from None
  File "/tmp/__autograph_generated_filehna_g91e.py", line 10, in tf__step
    y = ag__.converted_call(ag__.ld(tf).reshape, (ag__.ld(x), [3, 5]), None, fscope)
        ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
ValueError: in user code:

    File "/work/train.py", line 5, in step  *
        y = tf.reshape(x, [3, 5])

    ValueError: Cannot reshape a tensor with 16 elements to shape [3,5] (15 elements) for '{{{{node Reshape}}}} = \
Reshape[T=DT_FLOAT, Tshape=DT_INT32](x, Reshape/shape)' with input shapes: [4,4], [2] and with input tensors \
computed as partial shapes: input[1] = [3,5].

"""

GRAPH_EXECUTION = f"""\
Traceback (most recent call last):
  File "/work/train.py", line 8, in <module>
    step(tf.zeros([4, 4]), tf.constant([7]))
  File "{SITE}/tensorflow/python/util/traceback_utils.py", line 167, in error_handler
    raise e.with_traceback(filtered_tb) from None
  File "{SITE}/tensorflow/python/eager/execute.py", line 53, in quick_execute
    tensors = pywrap_tfe.TFE_Py_Execute(ctx._handle, device_name, op_name,
  ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
tensorflow.python.framework.errors_impl.InvalidArgumentError: Graph execution error:

Detected at node GatherV2 defined at (most recent call last):
  File "/work/train.py", line 8, in <module>

  File "/work/train.py", line 5, in step

indices[0] = 7 is not in [0, 4)
\t [[{{{{node GatherV2}}}}]] [Op:__inference_step_13]
"""

KERAS_CALL = f"""\
Traceback (most recent call last):
  File "/work/train.py", line 4, in <module>
    m.fit(np.zeros((8, 5)), np.zeros((8, 2)), verbose=0)
  File "{SITE}/keras/src/utils/traceback_utils.py", line 122, in error_handler
    raise e.with_traceback(filtered_tb) from None
  File "{SITE}/keras/src/layers/input_spec.py", line 239, in assert_input_compatibility
    raise ValueError(
ValueError: Exception encountered when calling Sequential.call().

\x1b[1mInput 0 with name 'None' of layer 'dense' is incompatible with the layer: expected axis -1 of input shape \
to have value 4, but received input with shape (None, 5)\x1b[0m

Arguments received by Sequential.call():
  \u2022 inputs=tf.Tensor(shape=(None, 5), dtype=float32)
  \u2022 training=True
  \u2022 mask=None
  \u2022 kwargs=<class 'inspect._empty'>
"""

ABORT = "eddis: aborting the MPI job after a failed collective (uncaught InvalidArgumentError on rank 0)\n"
TF_LOG = "W0000 00:00:1796505987.048769   13331 local_rendezvous.cc:412] Local rendezvous is aborting\n"


def caught(text):
    catcher = TracebackCatcher()
    for line in text.splitlines(keepends=True):
        catcher.feed(line.encode())
    return catcher.result()


def test_a_tf_function_traced_error_keeps_the_users_line_and_the_error():
    for after in ("", ABORT, TF_LOG + ABORT, "\n" + ABORT):
        assert caught(IN_USER_CODE + after) == IN_USER_CODE.rstrip("\n"), repr(after)
    report = caught(IN_USER_CODE)
    assert '    File "/work/train.py", line 5, in step  *' in report.splitlines()
    assert "    ValueError: Cannot reshape a tensor with 16 elements" in report


def test_a_graph_execution_error_keeps_the_node_the_users_lines_and_the_op():
    # its last line, "[Op:...]", ends it: what follows is not part of it, even unprefixed
    for after in ("", ABORT, "step 3 done\n"):
        assert caught(GRAPH_EXECUTION + after) == GRAPH_EXECUTION.rstrip("\n"), repr(after)
    assert "indices[0] = 7 is not in [0, 4)" in caught(GRAPH_EXECUTION).splitlines()


def test_a_keras_error_keeps_its_message_after_the_blank_line():
    for after in ("", ABORT, TF_LOG):
        assert caught(KERAS_CALL + after) == KERAS_CALL.rstrip("\n"), repr(after)


def test_a_one_line_message_ends_at_its_line_and_a_chained_traceback_is_not_part_of_it():
    one = 'Traceback (most recent call last):\n  File "t.py", line 1, in <module>\nKeyError: \'x\'\n'
    assert caught(one + "loss 0.5\nTraceback (most recent call last):\n") == one.rstrip("\n")
    chained = one + "\nDuring handling of the above exception, another exception occurred:\n\n" + one
    assert caught(chained) == one.rstrip("\n")
    # a message that announces more lines and never ends is cut, not the whole stderr
    endless = one.replace("KeyError: 'x'", "RuntimeError: details follow:") + "".join(
        f"    detail {i}\n" for i in range(3 * MESSAGE_SCAN_LINES))
    lines = caught(endless).splitlines()
    first, last = MAX_MESSAGE_LINES - 2, MESSAGE_SCAN_LINES - 1
    assert lines[-LAST_MESSAGE_LINES - 2:] == [f"    detail {first}", "    ...", *(
        f"    detail {i}" for i in range(last - LAST_MESSAGE_LINES + 1, last + 1))], lines


def test_a_long_traceback_keeps_its_first_and_last_frames_and_the_message():
    own = IN_USER_CODE.rstrip("\n").splitlines()
    message_at = own.index("ValueError: in user code:")
    frames = [f'  File "f{i}.py", line {i}, in f{i}' if j == 0 else "    g()"
              for i in range(MAX_TRACEBACK_LINES) for j in range(2)] + own[1:message_at]
    lines = caught("\n".join(own[:1] + frames + own[message_at:]) + "\n").splitlines()
    head = MAX_TRACEBACK_LINES - LAST_FRAME_LINES
    # the frames right before the error (the user's script's, tf.function's) and the message
    assert lines == own[:1] + frames[:head - 1] + ["    ..."] + frames[-LAST_FRAME_LINES:] + own[message_at:]


# what a trainer under eddis-train printed: TensorFlow lists the runner's frames too
UNDER_THE_RUNNER = """\
Traceback (most recent call last):
  File "/work/train.py", line 32, in <module>
    running_step(tf.zeros([4, 4]), tf.constant([7 if bad else 1]))
  File "{site}/tensorflow/python/util/traceback_utils.py", line 167, in error_handler
    raise e.with_traceback(filtered_tb) from None
  File "{site}/tensorflow/python/eager/execute.py", line 59, in quick_execute
    except TypeError as e:
tensorflow.python.framework.errors_impl.InvalidArgumentError: Graph execution error:

Detected at node GatherV2 defined at (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main

  File "<frozen runpy>", line 88, in _run_code

  File "{site}/eddis/launch/child.py", line 119, in <module>

  File "{site}/eddis/launch/child.py", line 102, in main

  File "<frozen runpy>", line 291, in run_path

{user_frames}  File "/work/train.py", line 25, in running_step

indices[0] = 7 is not in [0, 4)
\t [[{{{{node GatherV2}}}}]] [Op:__inference_running_step_12]
"""


def test_the_runners_frames_leave_a_graph_error_and_a_deep_one_keeps_its_error():
    text = UNDER_THE_RUNNER.format(site=SITE, user_frames='  File "/work/train.py", line 32, in <module>\n\n')
    lines = caught(text).splitlines()
    assert not [line for line in lines if "runpy" in line or "child.py" in line], lines
    assert lines[-6:] == ['  File "/work/train.py", line 32, in <module>', "", '  File "/work/train.py", line 25, '
                          "in running_step", "", "indices[0] = 7 is not in [0, 4)",
                          "\t [[{{node GatherV2}}]] [Op:__inference_running_step_12]"]
    # a model's frames are many: the first ones, and the last ones with the error
    deep = "".join(f'  File "/work/model.py", line {i}, in layer{i}\n\n' for i in range(MAX_MESSAGE_LINES))
    lines = caught(UNDER_THE_RUNNER.format(site=SITE, user_frames=deep)).splitlines()
    assert "    ..." in lines and lines[-3:] == ["", "indices[0] = 7 is not in [0, 4)",
                                                 "\t [[{{node GatherV2}}]] [Op:__inference_running_step_12]"]
